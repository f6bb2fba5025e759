// An upstream service in Node (amqplib): a draw, a draw.batch, a red packet
// created and grabbed, each a request with publisher confirms and a reply
// over RabbitMQ's direct reply-to. Written from docs/protocol.md and
// docs/schema/.
//
//   (cd examples/node && npm install)
//   AMQP_URL=amqp://guest:guest@127.0.0.1:5672/%2f POOL=gift-1001 node examples/node/prizepool_example.js
//
// Prints each reply as a JSON line; exits 1 if any request was refused.
// The red-packet sender (SENDER) needs a balance of at least 1,000 coins.
//
// Numbers: JSON.parse reads numbers as doubles, exact only below 2^53
// (Number.MAX_SAFE_INTEGER). Keep user ids and amounts below it, or parse
// replies with a big-integer-aware JSON reader.
'use strict';
const amqp = require('amqplib');
const { randomUUID } = require('crypto');

const AMQP_URL = process.env.AMQP_URL || 'amqp://guest:guest@127.0.0.1:5672/%2f';
const POOL = process.env.POOL || 'gift-1001';
const USER = Number(process.env.USER_ID || 42);
const SENDER = Number(process.env.SENDER || 7);
const TIMEOUT_MS = Number(process.env.TIMEOUT_S || 10) * 1000;

// Requests go to one exchange, under the routing key of their queue.
const EXCHANGE = 'prizepool';
const REPLY_TO = 'amq.rabbitmq.reply-to';

async function connect(url) {
  const connection = await amqp.connect(url);
  // A confirm channel: each publish's callback fires on the broker's confirm.
  const channel = await connection.createConfirmChannel();
  const pending = new Map();
  const settle = (id, fn, value) => {
    const p = pending.get(id);
    if (!p) return;
    pending.delete(id);
    clearTimeout(p.timer);
    p[fn](value);
  };
  // Direct reply-to: consume before the first publish that names it.
  await channel.consume(REPLY_TO, (msg) => {
    settle(msg.properties.correlationId, 'resolve', JSON.parse(msg.content.toString('utf8')));
  }, { noAck: true });
  // mandatory: an unroutable request comes back here (and is then confirmed).
  channel.on('return', (msg) => {
    settle(msg.properties.correlationId, 'reject', new Error('unroutable: no queue took the request'));
  });

  async function call(routingKey, message) {
    const correlationId = randomUUID();
    const reply = new Promise((resolve, reject) => {
      const timer = setTimeout(() => settle(correlationId, 'reject', new Error(
        `no reply within ${TIMEOUT_MS} ms; the request stays queued, send it again with the same id`)), TIMEOUT_MS);
      pending.set(correlationId, { resolve, reject, timer });
    });
    // The reply may be refused (a return) before the caller awaits it: mark
    // it handled now, so Node does not end the process on an "unhandled"
    // rejection; the caller still sees the error when it awaits.
    reply.catch(() => {});
    await new Promise((resolve, reject) => {
      channel.publish(EXCHANGE, routingKey, Buffer.from(JSON.stringify(message), 'utf8'), {
        contentType: 'application/json',
        deliveryMode: 2,
        replyTo: REPLY_TO,
        correlationId,
        mandatory: true,
      }, (err) => {
        if (!err) return resolve();
        // Refused (a nack): nothing is queued, so no reply will come.
        settle(correlationId, 'reject', err);
        return reject(err);
      });
    });
    return reply;
  }
  return { call, close: () => connection.close() };
}

const newId = (prefix = '') => prefix + randomUUID().replace(/-/g, '');

async function main() {
  const client = await connect(AMQP_URL);
  const steps = [];
  steps.push(['draw', await client.call('draw', {
    type: 'draw', request_id: newId(), pool: POOL, user_id: USER, count: 10,
  })]);
  steps.push(['draw.batch', await client.call('draw', {
    type: 'draw.batch',
    requests: [0, 1, 2].map((i) => ({ request_id: newId(), pool: POOL, user_id: USER + i, count: 1 + i })),
  })]);
  const packet = newId('rp-');
  steps.push(['redpacket.create', await client.call('refill', {
    type: 'redpacket.create', packet_id: packet, sender: SENDER,
    total: 1000, count: 5, min: 1, expires_in_s: 3600,
  })]);
  // A grab is a draw on the packet's id, one share at a time.
  steps.push(['grab', await client.call('draw', {
    type: 'draw', request_id: newId(), pool: packet, user_id: USER, count: 1,
  })]);
  await client.close();
  let refused = false;
  for (const [step, reply] of steps) {
    console.log(JSON.stringify({ step, reply }));
    const statuses = reply.results ? reply.results.map((r) => r.status) : [reply.status];
    refused = refused || statuses.some((s) => s !== 'ok');
  }
  return refused ? 1 : 0;
}

main().then((code) => process.exit(code), (err) => {
  console.error(err.message);
  process.exit(2);
});
