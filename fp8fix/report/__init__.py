"""What fp8fix tells people and machines: text and JSON for each command, and the model card."""
