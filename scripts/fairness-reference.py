#!/usr/bin/env python3
"""An independent implementation of docs/fairness.md, written from the
document alone, for cross-checking prizepool's own (src/fairness.rs).

    fairness-reference.py SEED_HEX CONTEXT N
        prints {"commitment", "key", "shuffle"}: the shuffle of [0..N).
    fairness-reference.py SEED_HEX POOL GENERATION VERSION COMBOS_JSON
        prints the lucky-gift batch of COMBOS_JSON ([[[multiplier, count], ...], ...])
        as [[combo index, [multiplier, ...]], ...].
    fairness-reference.py lottery SEED_HEX ACTIVITY PERIOD REQUEST_ID WEIGHTS_JSON
        prints the lottery draw of REQUEST_ID in the seed period starting at
        PERIOD (unix seconds) over WEIGHTS_JSON ([weight, ...], the candidates
        in the order the draw walked them) as {"commitment", "context", "key",
        "words" (the first 4 keystream words), "values" (their top 52 bits),
        "value" (the first accepted), "index" (of the value), "pick" (the
        candidate, counting from 0)}.
"""
import hashlib
import hmac
import json
import struct
import sys


def _rotl(v, c):
    return ((v << c) & 0xFFFFFFFF) | (v >> (32 - c))


def _quarter(s, a, b, c, d):
    s[a] = (s[a] + s[b]) & 0xFFFFFFFF; s[d] = _rotl(s[d] ^ s[a], 16)
    s[c] = (s[c] + s[d]) & 0xFFFFFFFF; s[b] = _rotl(s[b] ^ s[c], 12)
    s[a] = (s[a] + s[b]) & 0xFFFFFFFF; s[d] = _rotl(s[d] ^ s[a], 8)
    s[c] = (s[c] + s[d]) & 0xFFFFFFFF; s[b] = _rotl(s[b] ^ s[c], 7)


def chacha20_block(key, counter):
    state = [0x61707865, 0x3320646E, 0x79622D32, 0x6B206574]
    state += list(struct.unpack("<8I", key))
    state += [counter & 0xFFFFFFFF, counter >> 32, 0, 0]
    w = state[:]
    for _ in range(10):
        _quarter(w, 0, 4, 8, 12); _quarter(w, 1, 5, 9, 13)
        _quarter(w, 2, 6, 10, 14); _quarter(w, 3, 7, 11, 15)
        _quarter(w, 0, 5, 10, 15); _quarter(w, 1, 6, 11, 12)
        _quarter(w, 2, 7, 8, 13); _quarter(w, 3, 4, 9, 14)
    return struct.pack("<16I", *[(w[i] + state[i]) & 0xFFFFFFFF for i in range(16)])


class Stream:
    def __init__(self, seed, context):
        self.key = hmac.new(seed, context.encode(), hashlib.sha256).digest()
        self.counter, self.buffer = 0, b""

    def next_u64(self):
        while len(self.buffer) < 8:
            self.buffer += chacha20_block(self.key, self.counter)
            self.counter += 1
        x, self.buffer = self.buffer[:8], self.buffer[8:]
        return int.from_bytes(x, "little")

    def uniform(self, n):
        zone = 2**64 - (2**64 % n)
        while True:
            x = self.next_u64()
            if x < zone:
                return x % n

    def shuffle(self, a):
        for i in range(len(a) - 1, 0, -1):
            j = self.uniform(i + 1)
            a[i], a[j] = a[j], a[i]


def lottery(seed, activity, period, request_id, weights):
    """docs/fairness.md, "Lotteries": values are the top 52 bits of the
    keystream words of the draw's context; the first below the largest
    multiple of the total weight under 2^52 is used, modulo the total."""
    context = f"prizepool/lottery/v1\n{activity}\n{period}\n{request_id}"
    stream = Stream(seed, context)
    total = sum(weights)
    limit = 2**52 - (2**52 % total)
    words, values, k = [], [], 0
    while True:
        word = stream.next_u64()
        words.append(word)
        values.append(word >> 12)
        if values[-1] < limit:
            break
        k += 1
    value, r = values[k], values[k] % total
    pick = 0
    while r >= weights[pick]:
        r -= weights[pick]
        pick += 1
    while len(words) < 4:
        words.append(stream.next_u64())
        values.append(words[-1] >> 12)
    return {"commitment": hashlib.sha256(seed).hexdigest(), "context": context,
            "key": stream.key.hex(), "words": words[:4], "values": values[:4],
            "value": value, "index": k, "pick": pick}


def main(args):
    if args[0] == "lottery":
        seed = bytes.fromhex(args[1])
        assert len(seed) == 32
        out = lottery(seed, args[2], int(args[3]), args[4], json.loads(args[5]))
        print(json.dumps(out))
        return
    seed = bytes.fromhex(args[0])
    assert len(seed) == 32
    if len(args) == 3:
        stream = Stream(seed, args[1])
        items = list(range(int(args[2])))
        stream.shuffle(items)
        out = {"commitment": hashlib.sha256(seed).hexdigest(), "key": stream.key.hex(), "shuffle": items}
    else:
        pool, generation, version, combos = args[1], int(args[2]), int(args[3]), json.loads(args[4])
        stream = Stream(seed, f"prizepool/lucky_gift/v1\n{pool}\n{generation}\n{version}")
        order = list(range(len(combos)))
        stream.shuffle(order)
        out = []
        for c in order:
            prizes = [m for m, count in combos[c] for _ in range(count)]
            stream.shuffle(prizes)
            out.append([c, prizes])
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
