#!/usr/bin/env python3
"""An independent Pub/Sub client for the tests: the emulator's REST API with the standard
library alone (urllib), never the relayer's code.

    pubsub-client.py HOST:PORT PROJECT setup TOPIC SUBSCRIPTION
        creates the topic and a pull subscription on it with message ordering enabled
        (a subscription receives what is published after it exists);
    pubsub-client.py HOST:PORT PROJECT pull SUBSCRIPTION
        pulls and acknowledges until nothing more comes, printing one JSON object per
        message in the order received: messageId, orderingKey, attributes, data (text).
"""

import base64
import json
import sys
import time
import urllib.error
import urllib.request


def call(base, method, path, body=None):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        f"{base}/v1/{path}",
        data=data,
        method=method,
        headers={"content-type": "application/json"},
    )
    # The emulator accepts connections a moment before it answers: retry for a while.
    for attempt in range(60):
        try:
            with urllib.request.urlopen(request, timeout=30) as answer:
                return json.loads(answer.read() or b"{}")
        except urllib.error.HTTPError as e:
            raise SystemExit(f"{method} {path}: HTTP {e.code} {e.read().decode()}")
        except (urllib.error.URLError, ConnectionError) as e:
            if attempt == 59:
                raise SystemExit(f"{method} {path}: {e}")
            time.sleep(0.5)


def main():
    host, project, verb, *args = sys.argv[1:]
    base = f"http://{host}"
    prefix = f"projects/{project}"
    if verb == "setup":
        topic, subscription = args
        call(base, "PUT", f"{prefix}/topics/{topic}", {})
        call(
            base,
            "PUT",
            f"{prefix}/subscriptions/{subscription}",
            {
                "topic": f"{prefix}/topics/{topic}",
                "enableMessageOrdering": True,
                "ackDeadlineSeconds": 600,
            },
        )
    elif verb == "pull":
        (subscription,) = args
        empty = 0
        # Three empty answers in a row: everything published has been received.
        while empty < 3:
            answer = call(
                base,
                "POST",
                f"{prefix}/subscriptions/{subscription}:pull",
                {"maxMessages": 1000, "returnImmediately": True},
            )
            received = answer.get("receivedMessages", [])
            if not received:
                empty += 1
                time.sleep(0.2)
                continue
            empty = 0
            for r in received:
                m = r["message"]
                print(
                    json.dumps(
                        {
                            "messageId": m["messageId"],
                            "orderingKey": m.get("orderingKey", ""),
                            "attributes": m.get("attributes", {}),
                            "data": base64.b64decode(m.get("data", "")).decode(
                                "utf-8", "replace"
                            ),
                        }
                    )
                )
            call(
                base,
                "POST",
                f"{prefix}/subscriptions/{subscription}:acknowledge",
                {"ackIds": [r["ackId"] for r in received]},
            )
    else:
        raise SystemExit(f"unknown verb {verb}")


if __name__ == "__main__":
    main()
