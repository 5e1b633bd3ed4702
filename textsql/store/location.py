"""A checkpoint store's URI opened through fsspec, and checked before anything starts.

Every scheme fsspec knows works through the same code; the credentials are the filesystem's own, read from the
launching process's environment (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY`` and ``AWS_ENDPOINT_URL`` for
S3, ``GOOGLE_APPLICATION_CREDENTIALS`` for gs://, ``AZURE_STORAGE_*`` for abfs://): never an argument, so never on
a command line, in ``launch.log`` or ``run.json``. The ranks' environment is kept free of them
(:data:`CREDENTIAL_PREFIXES`).

:func:`check_store` reports what would fail later as one line before any worker starts: a scheme fsspec does not
know, or whose package is missing (s3fs is the ``store`` extra), a bucket that does not exist, keys the store does
not accept (S3's ``SignatureDoesNotMatch``, said in words), keys that may not write, no keys or half of them, an
endpoint nothing answers at or that is not a URL.

Usage::

    >>> store = open_store("s3://checkpoints/runs/r1")
    >>> check_store(store)
    >>> store.path("checkpoint-200", "latest")
    'checkpoints/runs/r1/checkpoint-200/latest'
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Mapping
from dataclasses import dataclass

import fsspec
from fsspec.core import split_protocol, url_to_fs
from fsspec.registry import known_implementations

from textsql.errors import StoreError

logger = logging.getLogger(__name__)

# The variables each filesystem reads its credentials and endpoint from: kept from the ranks' environment.
CREDENTIAL_PREFIXES = ("AWS_", "GOOGLE_APPLICATION_CREDENTIALS", "AZURE_STORAGE_")
# The packages behind the object stores, and the extra that installs the one this project pins.
STORE_PACKAGES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "abfs": "adlfs", "az": "adlfs"}
PINNED_EXTRA = "s3fs"
INSTALL_HINT = {
    PINNED_EXTRA: "pip install 'textsql[store]'",
    "gcsfs": "pip install gcsfs",
    "adlfs": "pip install adlfs",
}
# What an object store's refusals mean, by the error code in its answer.
REFUSALS = {
    "SignatureDoesNotMatch": "the secret key does not match the access key (SignatureDoesNotMatch): "
    "check AWS_SECRET_ACCESS_KEY",
    "InvalidAccessKeyId": "the store knows no such access key (InvalidAccessKeyId): check AWS_ACCESS_KEY_ID",
    "AccessDenied": "these keys may not write there (AccessDenied): use keys with write permission on the bucket",
    "NoSuchBucket": "the bucket does not exist (NoSuchBucket): create it, or fix the bucket in the URI",
    # botocore's own, which s3fs passes on untranslated: matched by the exception's name.
    "NoCredentialsError": "no credentials found (NoCredentialsError): set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
    "(or AWS_PROFILE) in the launching environment",
    "EndpointConnectionError": "nothing answers at the endpoint (EndpointConnectionError): check AWS_ENDPOINT_URL "
    "and that the server is up",
}
# botocore's names of the credential variables missing from a partial set, and how it says a URL is not one.
PARTIAL_CREDENTIALS = "PartialCredentialsError"
NOT_A_URL = "Invalid endpoint: "
LOCAL_PROTOCOL = "file"
# The object a write check puts and removes.
PROBE_PREFIX = ".textsql-write-check-"


@dataclass(frozen=True)
class Store:
    """An opened checkpoint store: its URI as given, its fsspec filesystem, and the path of its root there."""

    uri: str
    fs: fsspec.AbstractFileSystem
    root: str

    def path(self, *parts: str) -> str:
        """The store's path of ``parts`` under its root.

        :rtype: str
        """
        return "/".join([self.root.rstrip("/"), *parts])

    def where(self) -> str:
        """The URI, with the endpoint when the filesystem has one of its own (an S3-compatible server).

        :rtype: str
        """
        endpoint = getattr(self.fs, "endpoint_url", None)
        return f"{self.uri} at {endpoint}" if endpoint else self.uri


def open_store(uri: str) -> Store:
    """The store at ``uri``, its filesystem built from the environment's credentials.

    :rtype: Store
    :raises StoreError: for a scheme fsspec does not know, or whose package is not installed.
    """
    scheme = split_protocol(uri)[0] or "file"
    try:
        fsspec.get_filesystem_class(scheme)
    except ValueError:
        raise StoreError(
            f"--checkpoint-store {uri!r}: unknown scheme {scheme!r}; use s3://BUCKET/PREFIX (or gs://, abfs://, "
            "file://)"
        ) from None
    except ImportError:
        package = STORE_PACKAGES.get(scheme) or known_implementations.get(scheme, {}).get("class", "?").split(".")[0]
        raise StoreError(
            f"--checkpoint-store {uri!r}: {scheme}:// needs the package {package}, not installed here; "
            f"{INSTALL_HINT.get(package, f'pip install {package}')}"
        ) from None
    # A filesystem of its own, with the credentials the environment holds now (fsspec caches one per arguments).
    # Object stores have no directories to create; a local (or mounted) one needs them made.
    local = {"auto_mkdir": True} if scheme == LOCAL_PROTOCOL else {}
    fs, root = url_to_fs(uri, skip_instance_cache=True, **local)
    if local:
        fs.makedirs(root, exist_ok=True)
    return Store(uri, fs, root)


def check_store(store: Store) -> None:
    """Check that the store's bucket exists and the keys may write there (an object put and removed).

    :raises StoreError: one line naming the store and the reason.
    """
    probe = store.path(PROBE_PREFIX + secrets.token_hex(4))
    # The bucket first: an S3-compatible server may create a missing bucket on the first write (SeaweedFS does).
    bucket = store.root if LOCAL_PROTOCOL in store.fs.protocol else store.root.split("/")[0]
    try:
        store.fs.ls(bucket)
        store.fs.pipe(probe, b"")
        store.fs.rm(probe)
    except Exception as error:
        if not _from_the_filesystem(error):
            raise
        raise StoreError(f"checkpoint store {store.where()}: {refusal(error)}") from None
    if LOCAL_PROTOCOL in store.fs.protocol:
        logger.info("checkpoint store %s: directory writable", store.where())
    else:
        logger.info("checkpoint store %s: bucket reachable, writable", store.where())


def _from_the_filesystem(error: BaseException) -> bool:
    """Whether a store's filesystem raised ``error``: fsspec's OSError and ValueError, and botocore's own errors, which
    s3fs passes on untranslated (no credentials, an endpoint nothing answers at). botocore's are known by their module,
    so the check imports nothing the store extra may not have installed."""
    return isinstance(error, OSError | ValueError) or any(
        cls.__module__.startswith("botocore.") for cls in type(error).__mro__
    )


def refusal(error: BaseException) -> str:
    """What an error of the store's filesystem means, in words (the store's own code in brackets).

    :rtype: str
    """
    text = f"{type(error).__name__} {error} {error.__cause__ or ''}"
    for code, meaning in REFUSALS.items():
        if code in text:
            return meaning
    if type(error).__name__ == PARTIAL_CREDENTIALS:
        missing = str(getattr(error, "kwargs", {}).get("cred_var", "AWS_SECRET_ACCESS_KEY"))
        return f"only part of the credentials are set ({PARTIAL_CREDENTIALS}): set {missing} too"
    if str(error).startswith(NOT_A_URL):
        return f"AWS_ENDPOINT_URL {str(error)[len(NOT_A_URL) :]!r} is not a URL: write it as http://HOST:PORT"
    if isinstance(error, FileNotFoundError):
        return REFUSALS["NoSuchBucket"]
    return f"{type(error).__name__}: {error}"


def without_store_credentials(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` less the variables the stores' filesystems read credentials from: what the ranks may see.

    :rtype: dict[str, str]
    """
    return {key: value for key, value in environ.items() if not key.startswith(CREDENTIAL_PREFIXES)}
