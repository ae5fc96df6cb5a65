"""Pure tensor functions (no parameters). Each has a naive reference in the tests."""
