-- one producer transaction: 20 messages, 10 % keyed over 100 keys
SELECT ring.enqueue(20, 10);
