"""Where the rivals benchmark measures: local servers behind latency proxies, or real buckets.

Both give the driver the same five calls: a :class:`~benchmarks.rivals.common.Context`
per measurement, the requests a proxy saw, counting and deleting what a system wrote,
reclaiming space, and closing.

- :class:`LocalServers`: SeaweedFS (S3) and fake-gcs-server (GCS) from ``backends/``,
  started here, each directly (0 ms) and behind ``backends.proxy.FaultProxy`` per RTT;
  with ``https=True`` (``--https``) also over HTTPS, trusted through a test CA.
- :class:`Buckets`: real ``s3://`` / ``gs://`` buckets given by URL (``--url``). Nothing
  is started and no latency is added: the RTT is the network's own. Credentials come from
  the environment (``AWS_*``, an instance role, or Google's application default
  credentials) and reach the worker processes through it, never through a Context, a log
  or a results file.
"""

from __future__ import annotations

import contextlib
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks.rivals.common import SCHEMES, Context


class LocalServers:
    """The servers, and a latency proxy per (store, RTT) in front of them.

    With ``https``, the same again over HTTPS: a test CA (``backends.tls.TestCA``), a
    ``backends.tls.TlsFront`` in front of each server for 0 ms, and for each RTT a
    latency proxy that serves HTTPS itself (``FaultProxy(tls=ca)``): TLS ends in the
    client-side proxy, so the latency sits between it and the server, as for HTTP, and
    the proxy still counts the requests. The handshakes themselves pay no added RTT.
    """

    DESCRIPTION = "loopback servers (SeaweedFS S3, fake-gcs-server)"

    def __init__(self, stores: list[str], profiles: list[int], log: Any = print, *, https: bool = False) -> None:
        import backends
        from backends.proxy import FaultProxy

        self.stack = contextlib.ExitStack()
        self.services: dict[str, Any] = {}
        self.proxies: dict[tuple[str, int, str], Any] = {}  # (store, ms, transport) → latency proxy
        self.fronts: dict[str, Any] = {}  # store → TLS front of the server (HTTPS at 0 ms)
        self.ca: Any = None
        try:
            if https:
                import shutil
                import tempfile

                from backends.tls import TestCA

                ca_dir = tempfile.mkdtemp(prefix="bench-peers-ca-")
                self.stack.callback(shutil.rmtree, ca_dir, True)
                self.ca = TestCA.create(Path(ca_dir))
            for store in stores:
                log(f"starting {store} server ...")
                service = backends.start_s3() if store == "s3" else backends.start_gcs()
                self.stack.callback(service.stop)
                self.services[store] = service
                port = int(service.endpoint_url.rsplit(":", 1)[1])
                if self.ca is not None:
                    from backends.tls import TlsFront

                    front = TlsFront("127.0.0.1", port, self.ca).start()
                    self.stack.callback(front.stop)
                    self.fronts[store] = front
                for ms in profiles:
                    if not ms:
                        continue
                    for transport in self.transports_for(store):
                        tls = self.ca if transport == "https" else None
                        proxy = FaultProxy("127.0.0.1", port, latency_ms=ms, tls=tls).start()
                        self.stack.callback(proxy.stop)
                        self.proxies[(store, ms, transport)] = proxy
        except BaseException:
            self.stack.close()
            raise

    def transports_for(self, store: str) -> tuple[str, ...]:
        """The transports each of this store's cells is measured over."""
        return ("http", "https") if self.ca is not None else ("http",)

    def close(self) -> None:
        self.stack.close()

    def endpoint(self, store: str, ms: int, transport: str = "http") -> str:
        if ms:
            return self.proxies[(store, ms, transport)].endpoint_url
        return self.fronts[store].endpoint_url if transport == "https" else self.services[store].endpoint_url

    def context(self, store: str, ms: int, *, transport: str = "http", **kw: Any) -> Context:
        service = self.services[store]
        extra = {"access_key": service.access_key, "secret_key": service.secret_key} if store == "s3" else {}
        if transport == "https":
            extra["ca_file"] = str(self.ca.ca_file)
        return Context(
            store=store,
            endpoint=self.endpoint(store, ms, transport),
            bucket=service.bucket,
            transport=transport,
            **extra,
            **kw,
        )

    def proxy_requests(self, store: str, ms: int, transport: str = "http") -> int | None:
        proxy = self.proxies.get((store, ms, transport))
        return proxy.stats.requests if proxy else None

    def list_and_delete(self, store: str, prefix: str) -> tuple[int, int]:
        """(objects, bytes) under ``prefix``, then delete them (direct, not through a proxy)."""
        service = self.services[store]
        if store == "s3":
            import obstore as obs

            client = service.obstore_client()
            found = _obstore_list_and_delete(client, prefix)
            with contextlib.suppress(Exception):  # s3fs-fuse (Orbax on S3) also writes the folder as an object
                obs.delete(client, prefix + "/")
            return found
        import gcsfs

        fs = gcsfs.GCSFileSystem(skip_instance_cache=True, **service.storage_options())
        root = f"{service.bucket}/{prefix}"
        try:
            files = fs.find(root, detail=True)
        except FileNotFoundError:
            files = {}
        if files:
            fs.rm(list(files), recursive=False)
        return len(files), sum(int(f.get("size", 0)) for f in files.values())

    def compact(self) -> None:
        """Ask SeaweedFS to reclaim the space of deleted objects (untimed, after each system's turn)."""
        service = self.services.get("s3")
        if service is None or service._process is None:
            return
        args = [a for a in service._process.popen.args if str(a).startswith("-master.port=")]
        if not args:
            return
        port = str(args[0]).split("=", 1)[1]
        with contextlib.suppress(OSError):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/vol/vacuum?garbageThreshold=0.01", timeout=300).read()


class Buckets:
    """Real buckets: one ``s3://bucket/prefix`` and/or one ``gs://bucket/prefix``.

    Every measurement writes under ``<prefix>/bench-peers/<run id>/…`` and its objects
    are deleted after each system's turn; nothing else in the bucket is touched.
    """

    def __init__(self, urls: list[str]) -> None:
        from objckpt.storage.obstore.config import split_bucket_url
        from objckpt.storage.urls import redact_url

        self.roots: dict[str, tuple[str, str]] = {}  # store → (bucket, prefix)
        self.shown: list[str] = []  # the URLs as the results name them (no user info, no query)
        for url in urls:
            scheme = url.partition("://")[0]
            store = next((store for store, s in SCHEMES.items() if s == scheme), None)
            bucket, prefix = split_bucket_url(url) if store else ("", "")
            if not bucket:
                raise ValueError(f"--url {redact_url(url)!r}: expected s3://bucket[/prefix] or gs://bucket[/prefix]")
            if store in self.roots:
                raise ValueError(f"--url {redact_url(url)!r}: one bucket per store ({store} given twice)")
            self.roots[store] = (bucket, prefix)
            self.shown.append(f"{scheme}://{bucket}/{prefix}".rstrip("/"))

    @property
    def stores(self) -> list[str]:
        return [store for store in ("s3", "gcs") if store in self.roots]

    def describe(self) -> str:
        """For the results' header (bucket and prefix only: no credentials)."""
        return f"real buckets ({', '.join(self.shown)}; no added latency: the RTT is the network's own)"

    def close(self) -> None:
        pass

    def _key(self, store: str, prefix: str) -> str:
        base = self.roots[store][1]
        return f"{base}/{prefix}" if base else prefix

    def transports_for(self, store: str) -> tuple[str, ...]:
        """The scheme the bucket's own endpoint speaks (HTTPS, unless the environment names
        an ``http://`` endpoint): measured as it is, never chosen here."""
        return (endpoint_transport(store, self.roots[store][0]),)

    def context(self, store: str, ms: int, *, prefix: str, transport: str | None = None, **kw: Any) -> Context:
        if ms:
            raise ValueError("real buckets are measured as they are: no added latency")
        own = self.transports_for(store)[0]
        if transport not in (None, own):
            raise ValueError(f"real buckets are measured over their own endpoint ({own}), not {transport}")
        return Context(
            store=store, endpoint="", bucket=self.roots[store][0], prefix=self._key(store, prefix), transport=own, **kw
        )

    def proxy_requests(self, store: str, ms: int, transport: str = "http") -> int | None:
        return None

    def list_and_delete(self, store: str, prefix: str) -> tuple[int, int]:
        """(objects, bytes) under ``prefix`` (below the URL's), then delete them."""
        return _obstore_list_and_delete(bucket_client(store, self.roots[store][0]), self._key(store, prefix))

    def compact(self) -> None:
        pass


def _native_spec(store: str, bucket: str) -> Any:
    """objckpt's translation of the environment for this bucket, or None where it has none."""
    import os

    from objckpt.storage.obstore.config import NotTranslatable, translate_gcs, translate_s3

    try:
        return (translate_s3 if store == "s3" else translate_gcs)(f"{SCHEMES[store]}://{bucket}", {}, os.environ)
    except NotTranslatable:
        return None


def endpoint_transport(store: str, bucket: str) -> str:
    """``"http"`` where the environment points the bucket's clients at an ``http://`` endpoint, else ``"https"``."""
    spec = _native_spec(store, bucket)
    return "http" if spec is not None and (spec.endpoint or "").startswith("http://") else "https"


def bucket_client(store: str, bucket: str) -> Any:
    """An obstore client for a real bucket, configured from the environment the way
    objckpt configures its own (``objckpt.storage.obstore.config``: ``AWS_*`` variables,
    ``GOOGLE_APPLICATION_CREDENTIALS``), so the raw ceiling signs and connects as objckpt
    does. Where objckpt would not take the native path (an AWS profile file, say), obstore
    reads the environment itself (instance roles and the metadata server included)."""
    from obstore.store import GCSStore, S3Store

    config: Any = None
    http = False
    spec = _native_spec(store, bucket)
    if spec is not None:
        config, http = spec.config, bool(spec.endpoint and spec.endpoint.startswith("http://"))
    options: Any = {"timeout": "600s", "connect_timeout": "30s", "allow_http": http}
    if store == "s3":
        return S3Store(bucket, config=config, client_options=options)
    return GCSStore(bucket, config=config, client_options=options)


def _obstore_list_and_delete(client: Any, prefix: str) -> tuple[int, int]:
    import obstore as obs

    metas = [m for batch in obs.list(client, prefix + "/") for m in batch]
    paths = [m["path"] for m in metas]
    for i in range(0, len(paths), 500):
        obs.delete(client, paths[i : i + 500])
    return len(metas), sum(m["size"] for m in metas)
