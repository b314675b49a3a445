"""The error of settings that cannot be used, in a module of its own: the kernel's light paths (``%load_ext``,
the device decision) raise it without importing torch, which ``nbfsdp.shared.config`` needs."""


class ConfigError(ValueError):
    """Settings that cannot be used; the message names the valid choices. The notebook shows it as IPython's
    ``UsageError`` (``nbfsdp.kernel.usage_errors``); code shared with the engines does not import IPython."""
