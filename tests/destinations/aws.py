"""The independent client of the AWS harnesses (tests/destinations/aws.rs): boto3 against
a moto server, creating what a test delivers to and reading back what arrived, as JSON on
standard output. Never the relayer's own code.

Usage: aws.py ENDPOINT COMMAND ARGS...
  sqs-create NAME [MAX_MESSAGE_BYTES]   create a queue (FIFO when NAME ends in .fifo)
  sqs-read NAME                         every message: {"body", "attributes", "group"}
  sns-create NAME                       a topic and an SQS queue subscribed to it (FIFO
                                        when NAME ends in .fifo); prints the topic ARN
  sns-read NAME                         every notification the queue got:
                                        {"body", "attributes", "group"}
  kinesis-create NAME SHARDS            a stream
  kinesis-read NAME                     every record, shard by shard in sequence order:
                                        {"shard", "sequence", "key", "data"}
  events-create BUS                     an event bus and a rule sending all its events to
                                        a CloudWatch Logs group (moto's SQS targets slow
                                        down as their queue grows; its log groups do not)
  events-read BUS                       every event: {"event"}
"""

import json
import sys

import boto3

ACCOUNT = "123456789012"
REGION = "us-east-1"


def client(endpoint, service):
    return boto3.client(
        service,
        endpoint_url=endpoint,
        region_name=REGION,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )


def queue_attributes(name, max_bytes=None):
    attributes = {"VisibilityTimeout": "900"}
    if name.endswith(".fifo"):
        attributes["FifoQueue"] = "true"
    if max_bytes:
        attributes["MaximumMessageSize"] = str(max_bytes)
    return attributes


def receive(sqs, url):
    """Up to 10 messages of the queue, deleted once read (a FIFO queue hands out a group's
    next message only once the one before is deleted)."""
    got = sqs.receive_message(
        QueueUrl=url,
        MaxNumberOfMessages=10,
        MessageAttributeNames=["All"],
        AttributeNames=["All"],
        WaitTimeSeconds=0,
    ).get("Messages", [])
    if got:
        sqs.delete_message_batch(
            QueueUrl=url,
            Entries=[
                {"Id": str(i), "ReceiptHandle": m["ReceiptHandle"]}
                for i, m in enumerate(got)
            ],
        )
    return [
        {
            "body": m["Body"],
            "attributes": {
                k: v.get("StringValue", "")
                for k, v in m.get("MessageAttributes", {}).items()
            },
            "group": m.get("Attributes", {}).get("MessageGroupId"),
        }
        for m in got
    ]


def drain_queue(sqs, url):
    """Every message of the queue, in the order received, until two receives in a row found
    nothing."""
    out = []
    empty = 0
    while empty < 2:
        got = receive(sqs, url)
        empty = 0 if got else empty + 1
        out.extend(got)
    return out


def main():
    endpoint, command, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    if command == "sqs-create":
        sqs = client(endpoint, "sqs")
        sqs.create_queue(
            QueueName=args[0],
            Attributes=queue_attributes(args[0], args[1] if len(args) > 1 else None),
        )
    elif command == "sqs-read":
        sqs = client(endpoint, "sqs")
        url = sqs.get_queue_url(QueueName=args[0])["QueueUrl"]
        for m in drain_queue(sqs, url):
            print(json.dumps(m))
    elif command == "sns-create":
        sns, sqs = client(endpoint, "sns"), client(endpoint, "sqs")
        name = args[0]
        fifo = name.endswith(".fifo")
        topic = sns.create_topic(
            Name=name, Attributes={"FifoTopic": "true"} if fifo else {}
        )["TopicArn"]
        queue = "sub-" + name
        url = sqs.create_queue(QueueName=queue, Attributes=queue_attributes(queue))[
            "QueueUrl"
        ]
        arn = f"arn:aws:sqs:{REGION}:{ACCOUNT}:{queue}"
        sns.subscribe(TopicArn=topic, Protocol="sqs", Endpoint=arn)
        print(topic)
    elif command == "sns-read":
        sqs = client(endpoint, "sqs")
        url = sqs.get_queue_url(QueueName="sub-" + args[0])["QueueUrl"]
        for m in drain_queue(sqs, url):
            # The SNS envelope: the message and its attributes.
            note = json.loads(m["body"])
            print(
                json.dumps(
                    {
                        "body": note["Message"],
                        "attributes": {
                            k: v["Value"]
                            for k, v in note.get("MessageAttributes", {}).items()
                        },
                        "group": m["group"],
                    }
                )
            )
    elif command == "kinesis-create":
        kinesis = client(endpoint, "kinesis")
        kinesis.create_stream(StreamName=args[0], ShardCount=int(args[1]))
    elif command == "kinesis-read":
        kinesis = client(endpoint, "kinesis")
        shards = kinesis.list_shards(StreamName=args[0])["Shards"]
        for shard in shards:
            iterator = kinesis.get_shard_iterator(
                StreamName=args[0],
                ShardId=shard["ShardId"],
                ShardIteratorType="TRIM_HORIZON",
            )["ShardIterator"]
            while iterator:
                page = kinesis.get_records(ShardIterator=iterator, Limit=10000)
                for r in page["Records"]:
                    print(
                        json.dumps(
                            {
                                "shard": shard["ShardId"],
                                "sequence": r["SequenceNumber"],
                                "key": r["PartitionKey"],
                                "data": r["Data"].decode(),
                            }
                        )
                    )
                if not page["Records"]:
                    break
                iterator = page.get("NextShardIterator")
    elif command == "events-create":
        events, logs = client(endpoint, "events"), client(endpoint, "logs")
        bus = args[0]
        events.create_event_bus(Name=bus)
        group = "/events/" + bus
        logs.create_log_group(logGroupName=group)
        events.put_rule(
            Name="all",
            EventBusName=bus,
            EventPattern=json.dumps({"account": [ACCOUNT]}),
        )
        events.put_targets(
            Rule="all",
            EventBusName=bus,
            Targets=[
                {"Id": "log", "Arn": f"arn:aws:logs:{REGION}:{ACCOUNT}:log-group:{group}"}
            ],
        )
    elif command == "events-read":
        logs = client(endpoint, "logs")
        pages = logs.get_paginator("filter_log_events").paginate(
            logGroupName="/events/" + args[0]
        )
        for page in pages:
            for e in page["events"]:
                print(json.dumps({"event": json.loads(e["message"])}))
    else:
        sys.exit(f"unknown command {command}")


if __name__ == "__main__":
    main()
