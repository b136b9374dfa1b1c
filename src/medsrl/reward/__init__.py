"""Answer extraction and grading against gold answers."""
