"""moto's server (as `moto_server`, same arguments) with workarounds for two performance bugs
of moto 5.2.5, which made the 5,000-message scenario's calls outlast the relayer's dispatch
deadline on a loaded machine, so that it sent again what moto had kept.

SQS: `Queue.attributes` computes every attribute, among them the three
`ApproximateNumberOfMessages*` counts, each a pass over all the queue's messages, and
`send_message` reads it for one setting (`ContentBasedDeduplication`). Every message sent
then costs time in proportion to the messages the queue holds: 0.6 s for a SendMessageBatch
of 10 at 2,500 messages. Here `attributes` counts the messages only when a count is asked
for (GetQueueAttributes).

EventBridge: each event sent to a rule's target is passed through the default input
template, whose ten JSONPath expressions moto compiles anew every time (`jsonpath_ng.ext.
parse` builds a parser each call): 40 ms for a PutEvents of 10 whatever the bus holds, most
of it compiling. Here a compiled expression is kept by its text.

Kinesis: a shard's `put_record` takes the highest sequence number + 1 without a lock (moto
says so: "not safe for concurrency"), and the server answers each request on a thread of
its own, so two PutRecords at once can give two records one sequence number and the later
overwrites the earlier, answered as written (20 of 4,000 records lost with 8 client
threads). Here a shard's `put_record` holds one lock, as Kinesis keeps a shard's writes
apart, so that a relayer or a benchmark may send calls at once (`concurrency` above 1).

Kinesis again: a shard finds its last sequence number by listing all its records
(`list(self.records.keys())[-1]`), for every record written, so a write costs time in
proportion to the records the shard holds. Here the last key is read from the end of the
(insertion-ordered) dict.

Everything else is moto's own code.
"""

import functools
import sys
import threading
from collections.abc import Mapping

import jsonpath_ng.ext
from moto.kinesis import models as kinesis_models
from moto.server import main
from moto.sqs import models

COUNTS = {
    "ApproximateNumberOfMessages",
    "ApproximateNumberOfMessagesDelayed",
    "ApproximateNumberOfMessagesNotVisible",
}
ATTRIBUTES = models.Queue.attributes.fget


class Attributes(Mapping):
    """A queue's attributes, each count computed when it is read."""

    def __init__(self, queue):
        self.queue = queue
        # moto's own computation with the counts made cheap for its duration.
        self.rest = ATTRIBUTES(_Uncounted(queue))

    def __getitem__(self, key):
        if key in COUNTS:
            return getattr(self.queue, models.camelcase_to_underscores(key))
        return self.rest[key]

    def __iter__(self):
        return iter(self.rest)

    def __len__(self):
        return len(self.rest)


class _Uncounted:
    """The queue, except that its counts read as 0 (replaced by [`Attributes`] on read)."""

    def __init__(self, queue):
        self.__dict__["_queue"] = queue

    def __getattr__(self, name):
        if name.startswith("approximate_number_of_messages"):
            return 0
        return getattr(self._queue, name)


GET_QUEUE_ATTRIBUTES = models.SQSBackend.get_queue_attributes


def get_queue_attributes(self, *args, **kwargs):
    return dict(GET_QUEUE_ATTRIBUTES(self, *args, **kwargs))


assert models.Queue.BASE_ATTRIBUTES[:3] == sorted(COUNTS), "moto's attributes changed"
models.Queue.attributes = property(Attributes)
models.SQSBackend.get_queue_attributes = get_queue_attributes
# moto's EventTemplateParser imports `parse` from the module at each call.
jsonpath_ng.ext.parse = functools.lru_cache(maxsize=256)(jsonpath_ng.ext.parse)

PUT_RECORD = kinesis_models.Shard.put_record
KINESIS_WRITES = threading.Lock()


def put_record(self, *args, **kwargs):
    with KINESIS_WRITES:
        return PUT_RECORD(self, *args, **kwargs)


kinesis_models.Shard.put_record = put_record


def get_max_sequence_number(self):
    return next(reversed(self.records), 0)


kinesis_models.Shard.get_max_sequence_number = get_max_sequence_number

if __name__ == "__main__":
    sys.exit(main())
