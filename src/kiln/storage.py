"""Storage behind a URL: the one way Kiln opens an fsspec filesystem (data inputs, shards, checkpoints), with
every s3:// call bounded, and the one error that says the server cannot be reached."""

from __future__ import annotations

import copy
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from kiln.errors import KilnError


def is_url(location: str | Path) -> bool:
    """An fsspec URL (s3://, gs://, memory://, file://), read through a filesystem, not the local path API."""
    return "://" in str(location)


# Every s3:// call is bounded: botocore's timeouts and attempts, unless data.storage_options' config_kwargs
# set their own; s3fs's own retry loop (which would multiply botocore's attempts, and nests) makes one try.
S3_CALL_BOUNDS = {"connect_timeout": 10, "read_timeout": 20, "retries": {"max_attempts": 3, "mode": "standard"}}


def filesystem(source: str, storage_options: dict[str, Any] | None = None):
    import fsspec

    storage_options = storage_options or {}
    s3 = source.split("://", 1)[0] in ("s3", "s3a")
    if s3:
        bounds = {**S3_CALL_BOUNDS, **(storage_options.get("config_kwargs") or {})}
        storage_options = {**storage_options, "config_kwargs": copy.deepcopy(bounds)}  # botocore edits `retries`
    try:
        fs, path = fsspec.core.url_to_fs(source, **storage_options)
    except (ImportError, ValueError) as exc:  # s3:// without s3fs installed; a scheme fsspec does not know
        from kiln.install import install_hint

        raise KilnError(f"{source}: no filesystem for this URL ({exc}); check the scheme, or install its "
                        f"filesystem, e.g. for s3://: {install_hint('s3')}") from None
    if s3:
        fs.retries = 1
    return fs, path


class StorageUnreachable(KilnError, OSError):
    """The storage server could not be reached, or stopped answering, after the client's own bounded attempts.
    A KilnError: one line wherever it happens (the driver's listing and re-stat, a task). An OSError: a task
    never takes it for damage in the data (`StorageWatch`), and it is not read again (pipeline.run_task): the
    run stops, keeping the finished tasks."""


# botocore's (ReadTimeoutError and ConnectionClosedError are its HTTPClientErrors), aiohttp's connect failure
_UNREACHABLE = {"EndpointConnectionError": "refused or unreachable", "ClientConnectorError": "refused or unreachable",
                "ConnectTimeoutError": "no connection within config_kwargs.connect_timeout",
                "ProxyConnectionError": "the proxy refused or is unreachable",
                "ReadTimeoutError": "no answer within config_kwargs.read_timeout",
                "ConnectionClosedError": "it closed the connection"}


def unreachable(exc: BaseException, source: str) -> StorageUnreachable | None:
    """`exc` as a StorageUnreachable naming the server, or None when it is another error."""
    if isinstance(exc, StorageUnreachable):
        return exc
    why = next((_UNREACHABLE[c.__name__] for c in type(exc).__mro__ if c.__name__ in _UNREACHABLE), None)
    if why is None:
        return None
    from urllib.parse import urlsplit

    url = urlsplit(str((getattr(exc, "kwargs", None) or {}).get("endpoint_url") or ""))
    host = f"{url.scheme}://{url.netloc}" if url.netloc else getattr(exc, "host", None)
    server = f"the storage server at {host}" if host else "the storage server"
    return StorageUnreachable(
        f"{source}: could not connect to {server} ({why}, on every attempt); the tasks finished so far are kept: "
        f"start the server or fix data.storage_options (client_kwargs.endpoint_url; config_kwargs: "
        f"connect_timeout, read_timeout, retries), then run the same command again to resume")


@contextmanager
def remote_call(source: str) -> Iterator[None]:
    """A call to the storage: a connection failure is a StorageUnreachable naming the server."""
    try:
        yield
    except Exception as exc:
        if (error := unreachable(exc, source)) is None or error is exc:
            raise
        raise error from None
