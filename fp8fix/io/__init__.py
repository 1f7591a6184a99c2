"""Everything that touches files: safetensors headers, checkpoint folders, source reads, the writer,
the staging folder, the Hub."""
