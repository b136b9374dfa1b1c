"""The answer-token logit features and their clustering that MEDS, the novelty bonus and evaluation all read."""
