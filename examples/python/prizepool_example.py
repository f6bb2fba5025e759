#!/usr/bin/env python3
"""An upstream service in Python (pika): a draw, a draw.batch, a red packet
created and grabbed, each a request with publisher confirms and a reply over
RabbitMQ's direct reply-to. Written from docs/protocol.md and docs/schema/.

    pip install -r examples/python/requirements.txt
    AMQP_URL=amqp://guest:guest@127.0.0.1:5672/%2f POOL=gift-1001 \
        python3 examples/python/prizepool_example.py

Prints each reply as a JSON line; exits 1 if any request was refused.
The red-packet sender (SENDER) needs a balance of at least 1,000 coins.
"""
import json
import os
import sys
import time
import uuid

import pika

AMQP_URL = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f")
POOL = os.environ.get("POOL", "gift-1001")
USER = int(os.environ.get("USER_ID", "42"))
SENDER = int(os.environ.get("SENDER", "7"))
TIMEOUT_S = float(os.environ.get("TIMEOUT_S", "10"))

# Requests go to one exchange, under the routing key of their queue.
EXCHANGE = "prizepool"
REPLY_TO = "amq.rabbitmq.reply-to"


class Prizepool:
    def __init__(self, url):
        self.connection = pika.BlockingConnection(pika.URLParameters(url))
        self.channel = self.connection.channel()
        # Publisher confirms: basic_publish waits for the broker's confirm and
        # raises NackError if refused, UnroutableError if no queue took it
        # (with mandatory=True).
        self.channel.confirm_delivery()
        # Direct reply-to: the consumer must exist before the first publish
        # that names amq.rabbitmq.reply-to, on the same channel.
        self.channel.basic_consume(REPLY_TO, self._on_reply, auto_ack=True)
        self.replies = {}

    def _on_reply(self, _channel, _method, properties, body):
        self.replies[properties.correlation_id] = json.loads(body)

    def call(self, routing_key, message):
        """Publishes one request and waits for its one reply."""
        correlation_id = uuid.uuid4().hex
        self.channel.basic_publish(
            EXCHANGE,
            routing_key,
            json.dumps(message).encode("utf-8"),
            pika.BasicProperties(
                content_type="application/json",
                delivery_mode=2,
                reply_to=REPLY_TO,
                correlation_id=correlation_id,
            ),
            mandatory=True,
        )
        deadline = time.monotonic() + TIMEOUT_S
        while correlation_id not in self.replies:
            left = deadline - time.monotonic()
            if left <= 0:
                # The broker took the request: it stays queued until a worker
                # takes it. Send it again with the same id to read its answer.
                raise TimeoutError(f"no reply to {message} within {TIMEOUT_S}s")
            self.connection.process_data_events(time_limit=left)
        return self.replies.pop(correlation_id)

    def close(self):
        self.connection.close()


def new_id(prefix=""):
    return prefix + uuid.uuid4().hex


def main():
    client = Prizepool(AMQP_URL)
    steps = []
    steps.append(("draw", client.call("draw", {
        "type": "draw", "request_id": new_id(), "pool": POOL, "user_id": USER, "count": 10,
    })))
    steps.append(("draw.batch", client.call("draw", {
        "type": "draw.batch",
        "requests": [
            {"request_id": new_id(), "pool": POOL, "user_id": USER + i, "count": 1 + i}
            for i in range(3)
        ],
    })))
    packet = new_id("rp-")
    steps.append(("redpacket.create", client.call("refill", {
        "type": "redpacket.create", "packet_id": packet, "sender": SENDER,
        "total": 1000, "count": 5, "min": 1, "expires_in_s": 3600,
    })))
    # A grab is a draw on the packet's id, one share at a time.
    steps.append(("grab", client.call("draw", {
        "type": "draw", "request_id": new_id(), "pool": packet, "user_id": USER, "count": 1,
    })))
    client.close()
    refused = False
    for step, reply in steps:
        print(json.dumps({"step": step, "reply": reply}))
        statuses = [r["status"] for r in reply.get("results", [])] or [reply.get("status")]
        refused |= any(s != "ok" for s in statuses)
    return 1 if refused else 0


if __name__ == "__main__":
    sys.exit(main())
