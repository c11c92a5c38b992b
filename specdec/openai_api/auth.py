"""Who may use the OpenAI-compatible API (specdec/openai_api/app.py): API keys, and how many
requests each key may have in flight. Pure: no server, no framework (docs/openai.md, "API
keys and limits").

Environment:
- OPENAI_API_KEYS: comma-separated keys.
- OPENAI_API_KEYS_FILE: a file of keys, one a line; blank lines and `#` lines are skipped.
  Both may be set: the keys are their union. With no key configured the API is open. An
  empty value counts as unset.
- MAX_CONCURRENT_PER_KEY: the most requests one key may have in flight (>= 1; unset or 0:
  no limit). Needs a key.
- OPENAI_CACHE_SALT_SECRET: the secret the keys' cache salts are keyed with (at least 16
  characters); unset: random at each start.

Keys are kept only as sha256 digests, and a presented key is compared with every one of
them (hmac.compare_digest, no early exit), so the time a check takes says nothing about
which key, or which part of one, matched. No message here holds a key.

With keys, each request's cache_salt (the scope of the prefix cache and the suffix store) is
HMAC-SHA256 under a server secret of its key's digest and the salt its body asked for: one
key's requests share their caches, no other key's do, and the salt reveals nothing of the key
nor can be made up by whoever knows one but not the secret (a gRPC caller that reaches
Triton directly sends whatever salt it likes).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

KEYS_VAR = "OPENAI_API_KEYS"
KEYS_FILE_VAR = "OPENAI_API_KEYS_FILE"
MAX_CONCURRENT_VAR = "MAX_CONCURRENT_PER_KEY"
SALT_SECRET_VAR = "OPENAI_CACHE_SALT_SECRET"
MIN_SALT_SECRET = 16  # characters

# OpenAI's wording (its own ends with where to find a key, which is this server's operator).
MISSING_KEY_MESSAGE = (
    "You didn't provide an API key. You need to provide your API key in an Authorization "
    "header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
)
WRONG_KEY_MESSAGE = "Incorrect API key provided. Ask this server's operator for a valid key."


def rate_limit_message(max_concurrent: int) -> str:
    return (
        f"Rate limit reached for requests in flight per API key: limit {max_concurrent}. "
        "Try again once one of this key's requests has ended."
    )


class SettingError(ValueError):
    """An access setting that cannot work; the message names the variable (and the path)."""


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


def keys_from_env(env: dict[str, str]) -> list[str]:
    """The configured keys: OPENAI_API_KEYS's and OPENAI_API_KEYS_FILE's, in that order."""
    keys = []
    if listed := env.get(KEYS_VAR):  # empty: unset (compose's ${OPENAI_API_KEYS:-})
        keys = [key.strip() for key in listed.split(",")]
        if not all(keys):
            raise SettingError(f"{KEYS_VAR}: an empty key (keys are separated by commas)")
    if path := env.get(KEYS_FILE_VAR):
        keys += _keys_from_file(path)
    return keys


def _keys_from_file(path: str) -> list[str]:
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        reason = error.strerror if isinstance(error, OSError) else "not UTF-8 text"
        raise SettingError(f"{KEYS_FILE_VAR}: cannot read {path}: {reason}") from None
    keys = [line.strip() for line in lines]
    keys = [key for key in keys if key and not key.startswith("#")]
    if not keys:
        raise SettingError(f"{KEYS_FILE_VAR}: {path} holds no key")
    return keys


def max_concurrent_from_env(env: dict[str, str], num_keys: int) -> int | None:
    """MAX_CONCURRENT_PER_KEY as a bound, or None for no limit (unset, empty or 0)."""
    text = env.get(MAX_CONCURRENT_VAR, "").strip()
    if not text:
        return None
    if not (text.isascii() and text.isdigit()):  # no sign, no fraction
        raise SettingError(f"{MAX_CONCURRENT_VAR}: {text!r} is not a whole number >= 0")
    if int(text) == 0:
        return None
    if num_keys == 0:
        raise SettingError(
            f"{MAX_CONCURRENT_VAR} limits each API key: it needs {KEYS_VAR} or {KEYS_FILE_VAR}"
        )
    return int(text)


def salt_secret_from_env(env: dict[str, str]) -> bytes:
    """OPENAI_CACHE_SALT_SECRET, or 32 random bytes when it is unset: a new secret at each
    start changes every key's salt, which costs only the cache hits of the requests before."""
    text = env.get(SALT_SECRET_VAR, "")
    if not text:  # empty: unset, as compose passes ${VAR:-}
        return secrets.token_bytes(32)
    if len(text) < MIN_SALT_SECRET:
        raise SettingError(
            f"{SALT_SECRET_VAR}: at least {MIN_SALT_SECRET} characters "
            "(a random one: openssl rand -hex 32)"
        )
    return text.encode("utf-8")


def bearer_token(authorization: bytes | None) -> bytes | None:
    """The key of an `Authorization: Bearer <key>` header; None when there is none."""
    if authorization is None:
        return None
    scheme, _, token = authorization.strip().partition(b" ")
    if scheme.lower() != b"bearer" or not token.strip():
        return None
    return token.strip()


@dataclass
class ApiKeys:
    """The configured keys (as digests) and the per-key bound. No key: everyone may pass."""

    digests: tuple[bytes, ...] = ()
    max_concurrent: int | None = None  # per key; None: no limit
    salt_secret: bytes = field(default_factory=lambda: secrets.token_bytes(32), repr=False)

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> ApiKeys:
        env = dict(os.environ if env is None else env)
        keys = keys_from_env(env)
        digests = tuple(dict.fromkeys(_digest(key.encode("utf-8")) for key in keys))
        limit = max_concurrent_from_env(env, len(digests))
        return cls(digests, limit, salt_secret_from_env(env))

    @property
    def required(self) -> bool:
        return bool(self.digests)

    def match(self, presented: bytes) -> bytes | None:
        """The digest of the configured key equal to `presented`, or None. Compares with
        every configured key whatever the outcome (constant time in the key's content)."""
        presented_digest = _digest(presented)
        found = None
        for digest in self.digests:
            if hmac.compare_digest(presented_digest, digest):
                found = digest
        return found

    def cache_salt(self, digest: bytes | None, requested: str | None) -> str | None:
        """The cache_salt a request goes to Triton with. With keys: 64 hex digits, HMAC-SHA256
        of the key's `digest` (fixed length) then the `requested` salt, so a key may split
        its own caches with salts of its choosing but never lands in another key's. Open:
        `requested` as given (None: none, the shared salt "")."""
        if not self.required:
            return requested
        if digest is None:  # the gate lets no request through without a configured key
            raise ValueError("cache_salt: a request without a key on an API that needs one")
        message = digest + (requested or "").encode("utf-8")
        return hmac.new(self.salt_secret, message, hashlib.sha256).hexdigest()

    def describe(self) -> str:
        """For the start-up log: how many keys and the limit, never a key."""
        if not self.required:
            return "no API key configured: open to anyone who can reach it"
        limit = self.max_concurrent
        per_key = f"at most {limit} request(s) in flight per key" if limit else "no per-key limit"
        return f"{len(self.digests)} API key(s), {per_key}"


@dataclass
class InFlight:
    """Requests in flight per key (its digest), bounded: take() before the work, give()
    once its response has ended, whatever ended it. Single-threaded (one event loop)."""

    max_per_key: int | None  # None: no limit
    counts: Counter[bytes] = field(default_factory=Counter)

    def take(self, key: bytes) -> bool:
        """Counts one more request of `key`; False (and counts nothing) when at the bound."""
        if self.max_per_key is not None and self.counts[key] >= self.max_per_key:
            return False
        self.counts[key] += 1
        return True

    def give(self, key: bytes) -> None:
        self.counts[key] -= 1
        if self.counts[key] <= 0:
            del self.counts[key]
