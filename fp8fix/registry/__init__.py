"""What fp8fix knows about the world, kept as data: architectures, formats, loaders."""
