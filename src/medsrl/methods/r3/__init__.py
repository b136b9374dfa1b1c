"""R3 (arXiv 2601.19620): replay, reflection and ranking rewards over a per-prompt response history."""
