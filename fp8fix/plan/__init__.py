"""The conversion plan: what every output tensor is made of (byte ranges, repeats, recodes,
rescales, requantizations), worked out before a byte is written."""
