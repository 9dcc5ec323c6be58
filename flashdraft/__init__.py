"""flashdraft: train DFlash speculative-decoding drafters end to end, with verified artifacts."""

__version__ = "0.1.0"
