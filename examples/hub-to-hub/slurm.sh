#!/usr/bin/env bash
# Convert a Hub repo into another as a Slurm array of 8 tasks, then finalize once all succeeded:
#   jobid=$(sbatch --parsable examples/hub-to-hub/slurm.sh org/model-FP8 me/model-FP8-fixed)
#   sbatch --dependency=afterok:$jobid --wrap "fp8fix convert org/model-FP8 --push-to-hub me/model-FP8-fixed --finalize"
# HF_TOKEN (write access to DEST) must be in the environment the tasks inherit.
#SBATCH --job-name=fp8fix-parts
#SBATCH --array=1-8
#SBATCH --cpus-per-task=4
#SBATCH --tmp=100G
set -euo pipefail
SOURCE=$1
DEST=$2
PARTS=${FP8FIX_PARTS:-8}  # the size of --array above
fp8fix convert "$SOURCE" --push-to-hub "$DEST" --part "${SLURM_ARRAY_TASK_ID}/${PARTS}" --max-disk 60GB
