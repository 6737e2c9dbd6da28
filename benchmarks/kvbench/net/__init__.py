"""Shaped network paths for benchmarks.

- `NetnsLink` (kvbench.net.netns): network namespace + veth pair + tc tbf; run the store server
  inside it (`RedisServer(netns=link.name, bind=link.ns_ip)`); results record link="tc-netns".
- `ThrottledStore` / `TokenBucketLink` (kvbench.net.throttle): in-process token bucket around any
  store, the fallback where the kernel path is not permitted; link="token-bucket".
- `JitterTrace` (kvbench.net.trace): time-varying rates for either.
"""

from kvbench.net.trace import JitterTrace

__all__ = ["JitterTrace", "NetnsLink", "ThrottledStore", "TokenBucketLink", "RedisServer"]


def __getattr__(name: str):
    if name == "NetnsLink":
        from kvbench.net.netns import NetnsLink

        return NetnsLink
    if name in ("ThrottledStore", "TokenBucketLink"):
        from kvbench.net import throttle

        return getattr(throttle, name)
    if name == "RedisServer":
        from kvbench.net.redis_server import RedisServer

        return RedisServer
    raise AttributeError(name)
