"""Pure FP8 numerics: dtype facts, codes and their values, recodings, requantization. No I/O."""
