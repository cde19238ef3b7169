"""The HTTP reference: a minimal plain-ASGI handler doing the same Redis reads, answering with orjson.

No framework, no validation, no decoding: the floor any HTTP feature server is measured against.
Env: BENCH_REDIS_URL, BENCH_PROJECT, BENCH_VIEW.
"""

import os

import orjson
import redis.asyncio as aioredis

client = aioredis.Redis.from_url(os.environ["BENCH_REDIS_URL"])
PREFIX = f"fs:{os.environ['BENCH_PROJECT']}:".encode()
VIEW = os.environ.get("BENCH_VIEW", "stats")


async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    ids = orjson.loads(body)["entities"]["user_id"]
    pipe = client.pipeline(transaction=False)
    for i in ids:
        pipe.hmget(PREFIX + b"{user_id=%d}" % i, [VIEW])
    values = await pipe.execute()
    payload = orjson.dumps({"values": [v[0].hex() if v[0] else None for v in values]})
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
