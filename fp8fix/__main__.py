"""`python -m fp8fix` runs the same CLI as the `fp8fix` console script."""

from fp8fix.entry import run

if __name__ == "__main__":
    run()
