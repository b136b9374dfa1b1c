"""medsrl: GRPO/DAPO for math with MEDS memory-enhanced reward shaping."""

__version__ = "0.1.0"
