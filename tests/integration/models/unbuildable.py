"""A factory that raises, as a model whose weights are missing does."""

MESSAGE = "weights file /nonexistent/unbuildable.pt is missing (injected build failure)"


def build():
    raise FileNotFoundError(MESSAGE)
