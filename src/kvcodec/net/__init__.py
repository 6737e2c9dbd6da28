"""Shaped network paths for benchmarks.

- `NetnsLink` (kvcodec.net.netns): network namespace + veth pair + tc tbf; run the store server
  inside it (`RedisServer(netns=link.name, bind=link.ns_ip)`); results record link="tc-netns".
- `ThrottledStore` / `TokenBucketLink` (kvcodec.net.throttle): in-process token bucket around any
  store, the fallback where the kernel path is not permitted; link="token-bucket".
- `JitterTrace` (kvcodec.net.trace): time-varying rates for either.
"""

from kvcodec.net.trace import JitterTrace

__all__ = ["JitterTrace", "NetnsLink", "ThrottledStore", "TokenBucketLink", "RedisServer"]


def __getattr__(name: str):
    if name == "NetnsLink":
        from kvcodec.net.netns import NetnsLink

        return NetnsLink
    if name in ("ThrottledStore", "TokenBucketLink"):
        from kvcodec.net import throttle

        return getattr(throttle, name)
    if name == "RedisServer":
        from kvcodec.net.redis_server import RedisServer

        return RedisServer
    raise AttributeError(name)
