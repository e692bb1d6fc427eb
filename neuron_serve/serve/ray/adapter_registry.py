"""The LoRA adapters a server serves, kept in Ray's own key-value store (the GCS), so every replica and the server
app read the same list.

An entry is adapter name -> its base model, its directory and a version: the model.yaml's ``lora_modules``
(each replica records them as it starts, version 0) and those ``/v1/load_lora_adapter`` added (a new version
each load, so an adapter loaded again from the same directory is read again by every replica). A replica loads an adapter into its
engines the first time a request for it reaches it (Ray Serve's model multiplexing sends the next ones to the
replicas that hold it); an entry removed (``/v1/unload_lora_adapter``) is refused by every route at once, and a
replica that held it drops it on the next request that names it (each such request reads the entry).
"""

from __future__ import annotations

import asyncio
import json

from ray.experimental import internal_kv

from .cluster import SERVER_APP

PREFIX = "lora-adapter:"


def _key(name: str) -> str:
    return PREFIX + name


def put(name: str, base: str, path: str, version: int) -> None:
    internal_kv._internal_kv_put(_key(name), json.dumps({"base": base, "path": path, "version": version}),  # noqa: SLF001
                                 namespace=SERVER_APP)


def remove(name: str) -> bool:
    """Forget adapter ``name``; False when it was not there."""
    return bool(internal_kv._internal_kv_del(_key(name), namespace=SERVER_APP))  # noqa: SLF001


def get(name: str) -> dict | None:
    """``{"base": model, "path": directory, "version": n}`` of adapter ``name``, or None."""
    value = internal_kv._internal_kv_get(_key(name), namespace=SERVER_APP)  # noqa: SLF001
    return json.loads(value) if value is not None else None


def entries() -> dict[str, dict]:
    """Every adapter: name -> ``{"base": model, "path": directory, "version": n}``."""
    found = {}
    for key in internal_kv._internal_kv_list(PREFIX, namespace=SERVER_APP):  # noqa: SLF001
        key = key.decode() if isinstance(key, bytes) else key
        entry = get(key[len(PREFIX):])
        if entry is not None:
            found[key[len(PREFIX):]] = entry
    return found


class ModelAdapters:
    """The adapters of one base model, as its replicas read them (generate/plane.py's Registry)."""

    def __init__(self, base: str) -> None:
        self.base = base

    async def find(self, name: str) -> tuple[str, int] | None:
        """Adapter ``name``'s (directory, version); None: not served. Read on every request that names an adapter
        (a GCS read, well under a millisecond), so an unload or a new version reaches every replica at once."""
        entry = await asyncio.get_running_loop().run_in_executor(None, get, name)
        return (entry["path"], entry["version"]) if entry is not None and entry["base"] == self.base else None

    async def all(self) -> dict[str, str]:
        """Every adapter of the model: name -> directory."""
        found = await asyncio.get_running_loop().run_in_executor(None, entries)
        return {name: entry["path"] for name, entry in sorted(found.items()) if entry["base"] == self.base}
