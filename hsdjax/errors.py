"""User-facing errors: raised for bad input or missing resources, printed by the CLI as one line."""


class HsdjaxError(Exception):
    """An error whose message is meant for the user (no traceback is shown for it)."""


class ModelNotInstalled(HsdjaxError):
    """A registered model whose files are not on this machine yet."""
