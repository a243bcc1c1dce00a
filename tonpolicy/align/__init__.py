"""`python -m tonpolicy.align compare A B`: the alignment harness's offline comparator (see
tonpolicy.align.report)."""
