"""The torch runtime: the only part of optpipe that imports torch."""
