#!/usr/bin/env python3
"""Instructions Redis spends on one lucky-gift draw step, and where.

Runs a private redis-server under valgrind's callgrind, loads the pool of
examples/pools.toml into it (`prizepool pool load`, which needs the
DATABASE_URL Postgres), loads the list-storage draw script as a function
library built the way src/scripts/function.rs builds it, makes 20 warm-up
draws of 10 prizes and then counts the instructions of 250 more. Counting
instructions, not seconds, gives the same figure on a busy machine.

Each argument is a line of the draw script's prelude (lib/*.lua and
draw_lucky_gift.lua) before which the step returns early, so the figure is
the cost of everything up to that line; `-` runs the whole step:

    python3 scripts/lua-cost.py - "local plan, in_pool = jackpot_pick"

FILL=N first stores N refusals in the pool's answer store (as many
requests answered before), so the buckets the draws read and write are as
full as a busy store's. STEADY=1 stores them an epoch (a day) before the
measured requests, which then read two planned epochs as a store does
every day after its first; AIM=1 aims every digest at one bucket. `claim` as the argument counts one claim of a new
request id instead of a draw step (claim.lua, after FILL claims):

    FILL=3000 python3 scripts/lua-cost.py claim

An argument indented by two spaces cuts inside a function (the function
returns nil, 0 there; a step that returns nothing counts as a cut step).

`breakdown` runs the whole step and the cuts of SECTIONS below, and prints
what each part of the step costs (the difference between two cuts):

    FILL=3000 python3 scripts/lua-cost.py breakdown Needs valgrind, redis-server, a release build of
`prizepool` (PRIZEPOOL, default target/release/prizepool) and the redis
Python package, which the script installs into target/lua-cost-venv.
"""

import glob
import os
import random
import re
import struct
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV = os.path.join(ROOT, "target", "lua-cost-venv")

if not os.environ.get("LUA_COST_VENV"):
    if not os.path.exists(os.path.join(VENV, "bin", "python")):
        subprocess.run([sys.executable, "-m", "venv", VENV], check=True)
        subprocess.run([os.path.join(VENV, "bin", "pip"), "install", "-q", "redis>=5"], check=True)
    os.environ["LUA_COST_VENV"] = "1"
    os.execv(os.path.join(VENV, "bin", "python"), [os.path.join(VENV, "bin", "python")] + sys.argv)

import redis  # noqa: E402  (installed above)

LUA = os.path.join(ROOT, "lua")
PRIZEPOOL = os.environ.get("PRIZEPOOL", os.path.join(ROOT, "target", "release", "prizepool"))
PORT = int(os.environ.get("LUA_COST_PORT", "6399"))
CALLS = 250


def read(path):
    with open(os.path.join(LUA, path)) as f:
        return f.read()


def library(name, cut=None):
    """The draw script's library, as src/scripts/function.rs lays it out."""
    prelude = (read("lib/answer.lua") + read("lib/award.lua") + read("lib/jackpot.lua")
               + read("lib/draw.lua") + "local function step(ARGV)\n"
               + read("draw_lucky_gift.lua") + "\nend\n")
    if cut:
        early = "do return nil, 0 end\n" if cut.startswith("  ") else "do return {'cut','',0} end\n"
        if cut not in prelude:
            sys.exit(f"no such line in the prelude: {cut!r}")
        prelude = prelude.replace(cut, early + cut, 1)
    many = read("lib/many.lua")
    if cut:
        # A step cut inside a function returns nothing.
        call = "step({unpack(ARGV, i, i + per - 1)})"
        if call not in many:
            sys.exit("lib/many.lua no longer calls the step as this script expects")
        many = many.replace(call, call + " or {'cut', '', 0}", 1)
    return (f"#!lua name={name}\nlocal KEYS, ARGV\n{prelude}\n"
            f"local function body()\n{many}\nend\n"
            f"redis.register_function('{name}', function(keys, args)\n"
            "KEYS, ARGV = keys, args\nOPEN = {}\nreturn body()\nend)\n")


def answering(name, script):
    """A script with lib/answer.lua as its prelude, laid out as
    src/scripts/function.rs lays out an `answering!` script."""
    return (f"#!lua name={name}\nlocal KEYS, ARGV\n{read('lib/answer.lua')}\n"
            f"local function body()\n{read(script)}\nend\n"
            f"redis.register_function('{name}', function(keys, args)\n"
            "KEYS, ARGV = keys, args\nOPEN = {}\nreturn body()\nend)\n")


# Request digests from a fixed seed: two runs (a build before and after a
# change) store and look up the same records in the same buckets.
DIGESTS = random.Random(7)


NOW = int(time.time())
# STEADY=1: the FILL requests were stored a whole epoch (90,000 s and the
# skew) before the measured ones, so these open a planned epoch and read
# the filled one before it, as every request does a day into a store's
# life; otherwise all of them land in the store's first, growing epochs.
PAST = NOW - 90_301 if os.environ.get("STEADY") == "1" else None
# AIM=1: every digest agrees on the bytes that place a record (4-6), as
# ids an attacker crafted would: the filled records and the measured
# requests all meet in one bucket.
AIM = os.environ.get("AIM") == "1"


def token(at):
    """A new request's token, as src/kinds/answer.rs builds it, at time
    `at` (0: the script reads the clock, as a claim does)."""
    d = bytearray(DIGESTS.randbytes(24))
    if AIM:
        d[3:6] = b"\x07\x07\x07"
        d[6] = 1
    return bytes(d) + struct.pack(">II", 90000, at)


def measure(cut):
    out = os.path.join(ROOT, "target", "lua-cost")
    os.makedirs(out, exist_ok=True)
    for f in glob.glob(os.path.join(out, "cg.*")):
        os.remove(f)
    server = subprocess.Popen(
        ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}/cg.%p",
         "redis-server", "--port", str(PORT), "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    r = redis.Redis(port=PORT)
    for _ in range(300):
        try:
            r.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.1)
    pool = open(os.path.join(ROOT, "examples", "pools.toml")).read().replace("gift-1001", "cost")
    with open(os.path.join(out, "pool.toml"), "w") as f:
        f.write(pool)
    env = dict(os.environ, REDIS_URL=f"redis://127.0.0.1:{PORT}")
    subprocess.run([PRIZEPOOL, "pool", "load", os.path.join(out, "pool.toml")],
                   check=True, capture_output=True, env=env)
    day = time.strftime("%Y%m%d", time.gmtime())
    keys = [f"pp:{{cost}}:{k}" for k in ("meta", "q", "held", f"spent:{day}", "rs")]
    DIGESTS.seed(7)
    fill = int(os.environ.get("FILL", "0"))
    if cut == "claim":
        r.function_load(answering("claim", "claim.lua"), replace=True)

        for _ in range(fill):
            r.fcall("claim", 1, "pp:rq:{7}", token(PAST or 0), "claim")
        fill = 20

        def draw():
            return r.fcall("claim", 1, "pp:rq:{7}", token(0), "claim")
    else:
        r.function_load(library("cost", cut), replace=True)
        r.function_load(answering("fill", "remember_refusal.lua"), replace=True)
        for _ in range(fill):
            r.fcall("fill", 1, keys[4], token(PAST or NOW), "sold_out")
        fill = 20

        def draw():
            return r.fcall("cost", 5, *keys, 4, 10, 90000, 0, token(NOW))

    for _ in range(max(fill, 20)):
        draw()
    subprocess.run(["callgrind_control", "-z", str(server.pid)], capture_output=True)
    for _ in range(CALLS):
        reply = draw()
    subprocess.run(["callgrind_control", "-d", str(server.pid)], capture_output=True)
    r.shutdown(nosave=True)
    server.wait()
    for path in glob.glob(os.path.join(out, "cg.*.1")):
        m = re.search(r"^(?:summary|totals):\s*(\d+)", open(path).read(), re.M)
        if m:
            first = reply[0]
            return int(m.group(1)) // CALLS, str(first) if isinstance(first, int) else first.decode()
    sys.exit("callgrind wrote no dump")


# The parts of a draw step, in the order it runs them: each is named by the
# line before which the part ends (None: the end of the step).
SECTIONS = [
    ("the call itself: FCALL, its arguments, the driver, the reply",
     "local m = redis.call('HMGET', KEYS[1], 'kind'"),
    ("one HMGET of the pool's meta", "local seen = replay_award(KEYS[1]"),
    ("the answer store's lookup: open it, read the bucket", "if m[1] ~= 'lucky_gift' or m[10] == 'sparse'"),
    ("checks, the jackpot gate, the position tracker", "local plan, in_pool = jackpot_pick("),
    ("the pick: LPOP of the prizes, their codes and positions", "local codes, origins = jackpot_take(KEYS[3], plan)"),
    ("held jackpots and the refill flag", "return draw_award({meta = KEYS[1]"),
    ("the fairness record", "  local serial = (tonumber(d.drawn) or 0) + d.count"),
    ("one HSET of the pool's meta", "  local version, asset = d.version or '0', d.asset or 'coin'"),
    ("the answer's text and its stored form", "  remember(d.result, d.token, award_stored("),
    ("the answer store's write: the bucket rebuilt and SET", None),
]


def breakdown():
    rows, before = [], 0
    for name, cut in SECTIONS:
        total, status = measure(cut)
        if cut is None and status != "ok":
            sys.exit(f"the whole step answered {status!r}, not ok")
        rows.append((name, total - before, total))
        before = total
    print("| part of the draw step | instructions | up to here |")
    print("|---|---|---|")
    for name, own, total in rows:
        print(f"| {name} | {own:,} | {total:,} |")


if __name__ == "__main__":
    if sys.argv[1:] == ["breakdown"]:
        breakdown()
        sys.exit(0)
    for arg in sys.argv[1:] or ["-"]:
        per_call, status = measure(None if arg == "-" else arg)
        status = {"1": "claimed"}.get(status, status)
        print(f"{per_call:>9,} instructions a call ({status})  {arg[:60]}")
