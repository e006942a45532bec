#!/usr/bin/python3
"""Third-party KV event publisher for the kvevents interop test.

Uses libzmq (python3-zmq) and python3-msgpack, the same libraries the engines
build on, to publish the reference vector payloads the way vLLM and SGLang do:
a PUB per rank on base_port+rank sending [topic, seq (8 bytes big-endian),
msgpack EventBatch], and (vLLM) a replay ROUTER answering
[identity, "", start_seq] with [identity, "", topic, seq, payload] per
buffered batch and the end marker [identity, "", "", 0xff*8, ""].

Protocol with the test (line based):
  stdout "ready"  sockets are bound; seq 0 (an empty batch) is repeated on
                  every rank until the test has seen it
  stdin  "go"     publish the scenario
  stdout "sent"   scenario published; replays are served until stdin closes
"""

import argparse
import json
import os
import select
import struct
import sys
import time

import msgpack
import zmq

END = struct.pack(">Q", 0xFFFFFFFFFFFFFFFF)


def vectors(path, name):
    with open(path) as f:
        for v in json.load(f)["vectors"]:
            if v["name"] == name:
                return v
    raise SystemExit("vector %s not found in %s" % (name, path))


def repack(v, hex_hash_fields=False):
    """Re-encode a vector's decoded batch with python-msgpack and check the
    bytes against the recorded payload."""
    batch = v["decoded"]
    if hex_hash_fields:
        for ev in batch[1]:
            ev["block_hashes"] = [bytes.fromhex(h) for h in ev["block_hashes"]]
    out = msgpack.packb(batch, use_bin_type=True)
    want = bytes.fromhex(v["zmq_frames"]["payload_hex"])
    if out != want:
        raise SystemExit("python-msgpack encoding of %s differs from the vector" % v["name"])
    return out


def line(s):
    sys.stdout.write(s + "\n")
    sys.stdout.flush()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", choices=["vllm", "sglang"], required=True)
    ap.add_argument("--base-port", type=int, required=True)
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--replay-port", type=int, default=0)
    ap.add_argument("--vectors", required=True)
    a = ap.parse_args()

    ctx = zmq.Context()
    pubs = []
    for r in range(a.ranks):
        s = ctx.socket(zmq.PUB)
        s.bind("tcp://127.0.0.1:%d" % (a.base_port + r))
        pubs.append(s)
    router = None
    if a.replay_port:
        router = ctx.socket(zmq.ROUTER)
        router.bind("tcp://127.0.0.1:%d" % a.replay_port)
    topic = b"kv-events" if a.engine == "vllm" else b""
    buffers = [dict() for _ in pubs]  # seq -> payload, per rank

    def publish(rank, seq, payload, live=True):
        buffers[rank][seq] = payload
        if live:
            pubs[rank].send_multipart([topic, struct.pack(">Q", seq), payload])

    def serve_replay():
        frames = router.recv_multipart()
        if len(frames) != 3:
            return
        ident, _, start = frames
        start = struct.unpack(">Q", start)[0]
        for seq in sorted(s for s in buffers[0] if s >= start):
            router.send_multipart([ident, b"", topic, struct.pack(">Q", seq), buffers[0][seq]])
        router.send_multipart([ident, b"", b"", END, b""])

    for r in range(a.ranks):
        publish(r, 0, msgpack.packb([time.time(), [], r], use_bin_type=True), live=False)
    line("ready")

    # Handshake: repeat seq 0 until the test says go; serve replays meanwhile
    # (the subscriber asks for the buffered history as soon as it connects).
    stdin = sys.stdin.fileno()
    poller = zmq.Poller()
    poller.register(stdin, zmq.POLLIN)
    if router is not None:
        poller.register(router, zmq.POLLIN)
    go = False
    while not go:
        for r in range(a.ranks):
            pubs[r].send_multipart([topic, struct.pack(">Q", 0), buffers[r][0]])
        for sock, _ in poller.poll(20):
            if sock == stdin:
                if os.read(stdin, 64).strip() != b"go":
                    return
                go = True
            else:
                serve_replay()

    vllm_file = os.path.join(a.vectors, "vllm_event_vectors.json")
    sgl_file = os.path.join(a.vectors, "sglang_event_vectors.json")
    if a.engine == "vllm":
        publish(0, 1, repack(vectors(vllm_file, "vllm_map_events_int_hashes")))
        publish(0, 2, repack(vectors(vllm_file, "vllm_map_events_bytes_hashes"), hex_hash_fields=True))
        # seq 3 is "lost" on the SUB: only the replay buffer has it.
        publish(0, 3, msgpack.packb([time.time(), [
            {"type": "BlockRemoved", "block_hashes": [3527878332947511115], "medium": "GPU"}], 0],
            use_bin_type=True), live=False)
        publish(0, 4, msgpack.packb([time.time(), [
            ["BlockStored", [42], None, [], 16, None, "GPU"]], 0], use_bin_type=True))
    else:
        publish(0, 1, repack(vectors(sgl_file, "sglang_tagged_array_events_rank0")))
        publish(0, 2, msgpack.packb([time.time(), [
            ["BlockStored", [-2360060374177730597], None, [0], 1, None, "GPU"]], 0], use_bin_type=True))
        publish(1, 1, repack(vectors(sgl_file, "sglang_tagged_array_salted_rank1")))
    line("sent")

    while True:
        for sock, _ in poller.poll(1000):
            if sock == stdin:
                if not os.read(stdin, 64):
                    return
            else:
                serve_replay()


if __name__ == "__main__":
    main()
