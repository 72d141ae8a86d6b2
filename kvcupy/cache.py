"""PagedKVCache: placeholder replaced by the manager implementation."""


class CacheFullError(RuntimeError):
    """The cache has no free page for the tokens asked for; nothing was changed."""


class PagedKVCache:
    pass
