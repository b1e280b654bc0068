"""Appendix A: the recorder's plain data, the player's HTML, the live panel's handlers."""

from __future__ import annotations

import json
import random
import re

import pytest

from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence
from nanovllm.sampling_params import SamplingParams
from nanovllm.viz.driver import FakeEngine, fake_token
from nanovllm.viz.panel import LivePanel, interactive_frontend, parse_prompt, static_note
from nanovllm.viz.player import (
    Player,
    caption,
    frame_html,
    frame_svg,
    keep_language,
    lang_text,
    player_html,
    reading_language,
    set_language,
)
from nanovllm.viz.recorder import Recorder, hash_hex

PREFIX = [11, 12, 13, 14, 15, 16, 17, 18]
CJK = re.compile(r"[\u3000-\u303f\u4e00-\u9fff\uff00-\uffef]")


def seq_of(frame: dict, seq_id: int) -> dict:
    return next(s for s in frame["seqs"] if s["id"] == seq_id)


def shared_prefix_run() -> tuple[FakeEngine, Sequence, Sequence]:
    engine = FakeEngine(num_kvcache_blocks=8, kvcache_block_size=4)
    a = engine.add([*PREFIX, 19, 20], max_tokens=3)
    engine.step()
    b = engine.add([*PREFIX, 30, 31, 32], max_tokens=5)
    engine.run()
    return engine, a, b


def check_invariants(frame: dict, block_size: int) -> None:
    free = frame["free_list"]
    assert len(free) == len(set(free))
    for block in frame["blocks"]:
        assert (block["state"] == "used") == (block["id"] not in free), block
        assert block["ref_count"] == len(block["owners"]), block
        assert (block["state"] == "used") == (block["ref_count"] > 0), block
        assert block["state"] != "cached" or block["hash"] is not None, block
        assert 0 <= block["num_tokens"] <= block_size
    live = frame["waiting"] + frame["running"]
    assert len(live) == len(set(live))
    for seq_id in live:
        s = seq_of(frame, seq_id)
        assert len(s["block_table"]) * block_size >= s["num_cached_tokens"], s


def plain(value: object) -> bool:
    if isinstance(value, dict):
        return all(isinstance(k, str) and plain(v) for k, v in value.items())
    if isinstance(value, list):
        return all(plain(v) for v in value)
    return value is None or isinstance(value, (str, int, float, bool))


# ---- recorder ---------------------------------------------------------------------------------


def test_observer_is_off_by_default_and_detaches():
    scheduler = Scheduler(num_kvcache_blocks=4, kvcache_block_size=4, max_num_seqs=2, max_num_batched_tokens=16)
    assert scheduler.observer is None
    recorder = Recorder(scheduler)
    assert scheduler.observer is recorder
    recorder.detach()
    assert scheduler.observer is None
    scheduler.add(Sequence([1, 2, 3], SamplingParams(max_tokens=2), block_size=4))
    assert [f["phase"] for f in recorder.frames] == ["start"]


def test_recording_is_plain_json_data():
    engine, _, _ = shared_prefix_run()
    recording = engine.recording
    assert plain(recording)
    assert json.loads(json.dumps(recording)) == recording
    assert recording["format"] == "nanovllm-viz" and recording["version"] == 1
    assert recording["block_size"] == 4 and recording["num_blocks"] == 8
    assert [f["index"] for f in recording["frames"]] == list(range(len(recording["frames"])))


def test_frames_follow_the_scheduler_events():
    engine = FakeEngine(num_kvcache_blocks=8, kvcache_block_size=4)
    first = engine.add([1, 2, 3, 4, 5], max_tokens=2)
    second = engine.add([6, 7, 8], max_tokens=2)
    engine.run()
    frames = engine.recording["frames"]
    phases = [f["phase"] for f in frames]
    assert phases[:2] == ["start", "add"] and frames[1]["event"]["added"] == [first.seq_id, second.seq_id]
    assert phases[2:] == ["schedule", "postprocess"] * ((len(phases) - 2) // 2)
    assert [f["step"] for f in frames[2::2]] == list(range(1, engine.steps + 1))
    prefill = frames[2]["event"]
    assert prefill["is_prefill"] and prefill["scheduled"] == [
        {"seq": first.seq_id, "num_tokens": 5}, {"seq": second.seq_id, "num_tokens": 3}]
    tokens = frames[3]["event"]["tokens"]
    assert [t["seq"] for t in tokens] == [first.seq_id, second.seq_id] and all(t["appended"] for t in tokens)
    assert frames[-1]["event"]["finished"] and all(s["status"] == "FINISHED" for s in frames[-1]["seqs"])


def test_snapshot_matches_the_block_manager_at_every_event():
    scheduler = Scheduler(num_kvcache_blocks=6, kvcache_block_size=4, max_num_seqs=4, max_num_batched_tokens=32)
    recorder = Recorder(scheduler)
    checked = []

    def observer(event: str, payload: dict) -> None:
        recorder(event, payload)
        frame, bm = recorder.frames[-1], scheduler.block_manager
        assert frame["free_list"] == list(bm.free_block_ids)
        assert frame["running"] == [s.seq_id for s in scheduler.running]
        assert frame["waiting"] == [s.seq_id for s in scheduler.waiting]
        for block, data in zip(bm.blocks, frame["blocks"], strict=True):
            assert data["id"] == block.block_id and data["ref_count"] == block.ref_count
            assert data["hash"] == (None if block.hash == -1 else f"{block.hash & (2**64 - 1):016x}")
            assert (data["state"] == "used") == (block.block_id in bm.used_block_ids)
        checked.append(event)

    scheduler.observer = observer
    for i in range(3):
        scheduler.add(Sequence([*PREFIX[:4], 100 + i, 7], SamplingParams(max_tokens=6, ignore_eos=True), block_size=4))
    while not scheduler.is_finished():
        seqs, is_prefill = scheduler.schedule()
        scheduler.postprocess(seqs, [fake_token(s) for s in seqs], is_prefill)
    assert {"add", "schedule", "postprocess"} <= set(checked)


def test_hash_hex():
    assert hash_hex(-1) is None
    assert hash_hex(255) == "00000000000000ff"
    assert hash_hex(-2) == "fffffffffffffffe"  # a signed 64-bit hash is shown as its unsigned bits


def test_shared_prefix_ref_count_two_then_one():
    engine, a, b = shared_prefix_run()
    frames = engine.recording["frames"]
    hit = next(f for f in frames if f["phase"] == "schedule" and f["event"]["cache_hits"])
    shared = seq_of(hit, a.seq_id)["block_table"][:2]
    assert hit["event"]["cache_hits"] == [{"seq": b.seq_id, "blocks": shared}]
    assert seq_of(hit, b.seq_id)["block_table"][:2] == shared
    assert [hit["blocks"][i]["ref_count"] for i in shared] == [2, 2]
    assert [hit["blocks"][i]["owners"] for i in shared] == [[a.seq_id, b.seq_id]] * 2
    done = next(f for f in frames if a.seq_id in f["event"].get("finished", []))
    assert [done["blocks"][i]["ref_count"] for i in shared] == [1, 1]
    assert [done["blocks"][i]["owners"] for i in shared] == [[b.seq_id]] * 2


def test_freed_block_stays_cached_and_a_hit_revives_it():
    engine = FakeEngine(num_kvcache_blocks=8, kvcache_block_size=4)
    c = engine.add([*PREFIX, 21], max_tokens=1)
    engine.run()
    frames = engine.recording["frames"]
    blocks = seq_of(frames[2], c.seq_id)["block_table"]
    after = frames[-1]
    assert [after["blocks"][i]["state"] for i in blocks] == ["cached", "cached", "free"]
    d = engine.add([*PREFIX, 40, 41], max_tokens=1)
    engine.run()
    hit = next(f for f in engine.recording["frames"] if f["phase"] == "schedule" and f["event"]["cache_hits"])
    assert hit["event"]["cache_hits"] == [{"seq": d.seq_id, "blocks": blocks[:2]}]
    assert [hit["blocks"][i]["state"] for i in blocks[:2]] == ["used", "used"]
    assert [hit["blocks"][i]["ref_count"] for i in blocks[:2]] == [1, 1]


def test_chunked_prefill_is_recorded():
    engine = FakeEngine(num_kvcache_blocks=10, kvcache_block_size=4, max_num_batched_tokens=8)
    seq = engine.add(list(range(50, 70)), max_tokens=2)
    engine.run()
    frames = engine.recording["frames"]
    prefills = [f for f in frames if f["phase"] == "schedule" and f["event"]["is_prefill"]]
    assert [f["event"]["scheduled"] for f in prefills] == [[{"seq": seq.seq_id, "num_tokens": n}] for n in (8, 8, 4)]
    posts = [frames[f["index"] + 1] for f in prefills]
    assert [p["event"]["tokens"][0]["appended"] for p in posts] == [False, False, True]
    assert posts[0]["waiting"] == [seq.seq_id]
    assert "chunk of 8 tokens, 12 left" in caption(prefills[0], "en")
    assert "分块 8 个 token，还剩 12 个" in caption(prefills[0], "zh")
    assert "partial chunk, no token yet" in caption(posts[0], "en")


def test_fork_and_copy_on_write_are_recorded():
    """Chapter 05's story in frames: the fork shares both blocks (ref count 2), the first decode step copies
    the shared partial block for one sample (caption and event say which), the other writes in place."""
    engine = FakeEngine(num_kvcache_blocks=8, kvcache_block_size=4)
    parent = engine.add(list(range(30, 37)), max_tokens=3, n=2)  # 7 tokens: a full block and a partial one
    engine.run()
    frames = engine.recording["frames"]
    fork = next(f for f in frames if f["phase"] == "postprocess" and f["event"]["forked"])
    ((child_id,),) = [[i for i in e["into"] if i != parent.seq_id] for e in fork["event"]["forked"]]
    assert fork["event"]["forked"] == [{"seq": parent.seq_id, "into": [parent.seq_id, child_id]}]
    assert all(t["appended"] for t in fork["event"]["tokens"])
    table = seq_of(fork, parent.seq_id)["block_table"]
    assert seq_of(fork, child_id)["block_table"] == table and seq_of(fork, child_id)["sample_index"] == 1
    assert [fork["blocks"][b]["ref_count"] for b in table] == [2, 2]
    assert f"forked into seq {parent.seq_id}, {child_id}" in caption(fork, "en")
    copy_frame = next(f for f in frames if f["phase"] == "schedule" and f["event"]["copies"])
    (copy,) = copy_frame["event"]["copies"]
    assert copy["seq"] == parent.seq_id and copy["from"] == table[1]
    assert seq_of(copy_frame, parent.seq_id)["block_table"] == [table[0], copy["to"]]
    assert seq_of(copy_frame, child_id)["block_table"] == table
    assert [copy_frame["blocks"][b]["ref_count"] for b in (*table, copy["to"])] == [2, 1, 1]
    assert f"copies shared block {table[1]} into block {copy['to']}" in caption(copy_frame, "en")
    assert f"把共享的块 {table[1]} 拷贝到块 {copy['to']}" in caption(copy_frame, "zh")
    svg = frame_svg(copy_frame, 4, frames[copy_frame["index"] - 1], lang="en")
    assert f'class="nvv-blk nvv-used nvv-copy" data-b="{copy["to"]}"' in svg  # the copy, outlined
    assert f'class="nvv-blk nvv-used nvv-copysrc" data-b="{copy["from"]}"' in svg  # and its source
    for frame in frames:
        check_invariants(frame, 4)
    assert sorted(frames[-1]["free_list"]) == list(range(8))


def test_preemption_storm_is_recorded_and_recovers():
    engine = FakeEngine(num_kvcache_blocks=6, kvcache_block_size=4)
    for i in range(4):
        engine.add([100 * (i + 1) + t for t in range(6)], max_tokens=8)
    engine.run()
    frames = engine.recording["frames"]
    storms = [f for f in frames if f["phase"] == "schedule" and f["event"]["preempted"]]
    assert storms
    for f in storms:
        victims = f["event"]["preempted"]
        assert f["waiting"][: len(victims)] == victims[::-1]  # each one went to the head of waiting
        assert all(seq_of(f, v)["block_table"] == [] for v in victims)
        assert f"preempted seq {victims[0]}" in caption(f, "en")
    for frame in frames:
        check_invariants(frame, 4)
    assert all(s["status"] == "FINISHED" for s in frames[-1]["seqs"])
    assert sorted(frames[-1]["free_list"]) == list(range(6))


@pytest.mark.parametrize("seed", range(6))
def test_invariants_hold_on_random_workloads(seed):
    rng = random.Random(seed)
    engine = FakeEngine(num_kvcache_blocks=rng.randint(5, 10), kvcache_block_size=rng.choice([2, 4]),
                        max_num_seqs=rng.randint(1, 4), max_num_batched_tokens=rng.choice([6, 8, 16]))
    prefixes = [[rng.randint(1, 50) for _ in range(4)] for _ in range(2)]
    capacity = engine.config["num_kvcache_blocks"] * engine.config["kvcache_block_size"]
    for _ in range(rng.randint(2, 6)):
        prompt = rng.choice(prefixes) + [rng.randint(1, 50) for _ in range(rng.randint(1, 5))]
        max_tokens = rng.randint(1, 6)
        if len(prompt) + max_tokens <= capacity:  # a request that can never fit is rejected (tested elsewhere)
            engine.add(prompt, max_tokens=max_tokens)
        engine.run(max_steps=rng.randint(0, 3))
    engine.run()
    recording = engine.recording
    for frame in recording["frames"]:
        check_invariants(frame, recording["block_size"])
    assert all(s["status"] == "FINISHED" for s in recording["frames"][-1]["seqs"])


def test_recorder_rejects_unknown_events():
    engine = FakeEngine(num_kvcache_blocks=4, kvcache_block_size=4)
    with pytest.raises(ValueError, match="unknown scheduler event 'tick'"):
        engine.recorder("tick", {})


# ---- player (hand-made recordings: plain data, no scheduler) ----------------------------------


def block(i: int, state: str = "free", ref: int = 0, owners=(), num_tokens: int = 0, hash_=None) -> dict:
    return {"id": i, "state": state, "ref_count": ref, "hash": hash_, "num_tokens": num_tokens,
            "owners": list(owners)}


def seq(i: int, status: str, n: int, cached: int = 0, scheduled: int = 0, table=()) -> dict:
    return {"id": i, "status": status, "num_tokens": n, "num_prompt_tokens": 6, "num_cached_tokens": cached,
            "num_scheduled_tokens": scheduled, "block_table": list(table)}


def hand_made() -> dict:
    """Two sequences of 6 tokens, blocks of 4: a prefill, then seq 1 is preempted and seq 0 finishes."""
    frames = [
        {"step": 0, "phase": "start", "event": {"num_blocks": 4, "block_size": 4},
         "blocks": [block(i) for i in range(4)], "free_list": [0, 1, 2, 3], "waiting": [], "running": [], "seqs": []},
        {"step": 0, "phase": "add", "event": {"added": [0, 1]}, "blocks": [block(i) for i in range(4)],
         "free_list": [0, 1, 2, 3], "waiting": [0, 1], "running": [],
         "seqs": [seq(0, "WAITING", 6), seq(1, "WAITING", 6)]},
        {"step": 1, "phase": "schedule",
         "event": {"is_prefill": True, "scheduled": [{"seq": 0, "num_tokens": 6}, {"seq": 1, "num_tokens": 6}],
                   "preempted": [], "cache_hits": []},
         "blocks": [block(0, "used", 1, [0], 4), block(1, "used", 1, [0], 2), block(2, "used", 1, [1], 4),
                    block(3, "used", 1, [1], 2)],
         "free_list": [], "waiting": [], "running": [0, 1],
         "seqs": [seq(0, "RUNNING", 6, 0, 6, [0, 1]), seq(1, "RUNNING", 6, 0, 6, [2, 3])]},
        {"step": 2, "phase": "schedule",
         "event": {"is_prefill": False, "scheduled": [{"seq": 0, "num_tokens": 1}], "preempted": [1],
                   "cache_hits": [{"seq": 0, "blocks": [0]}]},
         "blocks": [block(0, "used", 1, [0], 4, "00000000000000aa"), block(1, "used", 1, [0], 3),
                    block(2, "cached", 0, [], 4, "00000000000000bb"), block(3)],
         "free_list": [3, 2], "waiting": [1], "running": [0],
         "seqs": [seq(0, "RUNNING", 7, 6, 1, [0, 1]), seq(1, "WAITING", 7)]},
        {"step": 2, "phase": "postprocess",
         "event": {"tokens": [{"seq": 0, "token": 5, "appended": True}], "finished": [0]},
         "blocks": [block(0, "cached", 0, [], 4, "00000000000000aa"), block(1),
                    block(2, "cached", 0, [], 4, "00000000000000bb"), block(3)],
         "free_list": [3, 2, 1, 0], "waiting": [1], "running": [],
         "seqs": [seq(0, "FINISHED", 8, 7), seq(1, "WAITING", 7)]},
    ]
    for k, frame in enumerate(frames):
        frame["index"] = k
    return {"format": "nanovllm-viz", "version": 1, "block_size": 4, "num_blocks": 4, "frames": frames}


def test_captions_say_what_happened():
    frames = hand_made()["frames"]
    assert caption(frames[0], "en") == "before step 1: empty pool: 4 blocks of 4 tokens"
    assert caption(frames[1], "en") == "before step 1: added seq 0 (prompt 6 tokens), seq 1 (prompt 6 tokens)"
    assert caption(frames[2], "en") == "step 1: prefill: seq 0 (6 tokens), seq 1 (6 tokens)"
    assert caption(frames[3], "en") == (
        "step 2: decode: seq 0 (1 token each) · cache hit on block 0 (seq 0) · preempted seq 1")
    assert caption(frames[4], "en") == "step 2 done: appended a token to seq 0 · finished seq 0 (blocks freed)"
    # The glossary keeps prefill and decode in English in Chinese text: the two step kinds read alike.
    assert caption(frames[2], "zh") == "第 1 步：prefill：序列 0（6 个 token）、序列 1（6 个 token）"
    assert caption(frames[3], "zh").startswith("第 2 步：decode：序列 0（各 1 个 token）")
    assert "抢占序列 1" in caption(frames[3], "zh") and "缓存命中：块 0（序列 0）" in caption(frames[3], "zh")
    with pytest.raises(ValueError, match="one language at a time"):
        caption(frames[0], "both")


def test_a_recorder_attached_to_a_pool_in_use_says_what_it_holds():
    """The server's live page attaches its recorder to an engine that has run: its first frame must not call a
    pool with used and cached blocks empty (it did, while drawing them as used and cached)."""
    scheduler = Scheduler(num_kvcache_blocks=6, kvcache_block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    done = Sequence(list(range(8)), SamplingParams(max_tokens=1, ignore_eos=True), block_size=4)
    running = Sequence(list(range(20, 25)), SamplingParams(max_tokens=6, ignore_eos=True), block_size=4)
    for seq in (done, running):
        scheduler.add(seq)
    seqs, is_prefill = scheduler.schedule()
    scheduler.postprocess(seqs, [7, 7], is_prefill)
    assert done.is_finished and not running.is_finished
    first = Recorder(scheduler, attach=False).frames[0]
    states = [block["state"] for block in first["blocks"]]
    assert (states.count("used"), states.count("cached")) == (2, 2)
    assert caption(first, "en") == "before step 1: pool of 6 blocks of 4 tokens: 2 in use, 2 cached, 2 free"
    assert caption(first, "zh") == "第 1 步之前：块池：6 个块，每块 4 个 token；2 个在用，2 个已缓存，2 个空闲"


def test_frame_svg_draws_block_states_ref_counts_and_tooltips():
    recording = hand_made()
    frames = recording["frames"]
    svg = frame_svg(frames[3], 4, prev=frames[2], lang="en")
    cells = {b: c for c, b in re.findall(r'<g class="(nvv-blk[^"]*)" data-b="(\d+)"', svg)}
    assert cells["0"] == "nvv-blk nvv-used nvv-hit"
    assert cells["2"] == "nvv-blk nvv-cached nvv-freed" and cells["3"] == "nvv-blk nvv-free nvv-freed"
    assert "<title>block 2 · cached · ref 0 · hash 00000000000000bb · seqs - · 4/4 tokens</title>" in svg
    assert re.search(r'class="nvv-rc"[^>]*>1</text>', svg)  # block 0's ref count
    # The block table row of seq 0 links to blocks 0 and 1; the queues show s0 running, s1 waiting.
    assert re.findall(r'<g class="nvv-ref[^"]*" data-b="(\d+)"', svg) == ["0", "1"]
    assert '<g class="nvv-chip" data-s="0">' in svg and '<g class="nvv-chip" data-s="1">' in svg
    first = frame_svg(frames[2], 4, prev=frames[1], lang="en")
    assert first.count("nvv-new") == 4  # the four blocks of the prefill are newly allocated


def test_player_html_is_self_contained():
    html = player_html(hand_made())
    lowered = html.lower()
    for forbidden in ("http://", "https://", "<link", " src=", "@import", "url(", "@font-face", "//cdn"):
        assert forbidden not in lowered, forbidden
    assert lowered.count("<script>") == 1 and "<style>" in lowered


def test_player_structure_and_controls():
    recording = hand_made()
    html = player_html(recording, start=2, player_id="p-test")
    assert html.startswith('<div class="nvv" id="p-test"')
    frames = re.findall(r'<div class="nvv-frame" data-frame="(\d+)"( hidden)?>', html)
    assert [int(k) for k, _ in frames] == list(range(5))
    assert [k for k, hidden in frames if not hidden] == ["2"]  # only the start frame shows without a script
    for act in ("first", "back", "play", "step", "last"):
        assert f'data-act="{act}"' in html
    assert 'max="4" value="2"' in html and "3 / 5" in html
    both = keep_language(html, "en") + keep_language(html, "zh")
    assert "Play" in both and "Step" in both and "播放" in both and "单步" in both
    assert "播放" not in player_html(recording, lang="en") and "Play" not in player_html(recording, lang="zh")


def test_players_on_one_page_do_not_collide():
    recording = hand_made()
    page = player_html(recording) + player_html(recording) + Player(recording)._repr_html_()
    ids = re.findall(r'\bid="([^"]+)"', page)
    assert len(ids) == 3 and len(set(ids)) == 3
    for player_id in ids:  # each script drives only its own element
        assert f'document.getElementById("{player_id}")' in page


def test_player_rejects_bad_input():
    recording = hand_made()
    with pytest.raises(TypeError, match="recording must be a dict"):
        player_html([1, 2])
    with pytest.raises(ValueError, match="no frames"):
        player_html({**recording, "frames": []})
    with pytest.raises(ValueError, match="block_size"):
        player_html({**recording, "block_size": 0})
    with pytest.raises(ValueError, match="lang must be one of"):
        player_html(recording, lang="fr")
    with pytest.raises(ValueError, match="start=5 is out of range"):
        player_html(recording, start=5)
    with pytest.raises(ValueError, match="interval_ms"):
        player_html(recording, interval_ms=0)
    with pytest.raises(ValueError, match="player_id"):
        player_html(recording, player_id='x" onclick="alert(1)')


def test_player_displays_in_notebooks_and_frame_html_needs_no_script():
    recording = hand_made()
    player = Player(recording, player_id="shown")
    assert player._repr_html_() == player_html(recording, player_id="shown")
    assert repr(player) == "Player(5 frames)"
    static = frame_html(recording, -1, lang="en")
    assert "<script" not in static and "finished seq 0" in static and static.count("<svg") == 1


def test_player_of_a_real_recording_survives_json():
    engine, _, _ = shared_prefix_run()
    recording = engine.recording
    again = json.loads(json.dumps(recording))
    assert player_html(again, player_id="x") == player_html(recording, player_id="x")
    assert "nvv-hit" in player_html(recording)


# ---- live panel ---------------------------------------------------------------------------------


def test_parse_prompt():
    assert parse_prompt(" 1 2,3 ,4\n5") == [1, 2, 3, 4, 5]
    with pytest.raises(ValueError, match="empty"):
        parse_prompt("  ")
    with pytest.raises(ValueError, match="integers"):
        parse_prompt("1 two 3")


def test_live_panel_buttons_drive_the_scheduler():
    panel = LivePanel(num_kvcache_blocks=8, kvcache_block_size=4, max_num_batched_tokens=16, lang="en")
    w = panel._build()
    view, message = w["view"], w["message"]
    assert "empty pool: 8 blocks" in view.value and w["pool_size"].value == 8
    w["step"].click()
    assert "nothing to do" in message.value
    w["prompt"].value = "1 2 3 4 5 6 7 8 9"
    w["max_tokens"].value = 3
    w["add"].click()
    assert "added seq" in view.value and panel.actions == [("add", [1, 2, 3, 4, 5, 6, 7, 8, 9], 3, 1)]
    w["step"].click()
    assert "step 1: prefill" in view.value and "step 1 done" in view.value
    assert "nvv-used" in view.value and "added seq" not in view.value
    w["prompt"].value = "1 2 3 4 5 6 7 8 42"
    w["add"].click()
    w["step"].click()
    assert "cache hit on blocks" in view.value
    w["preempt"].click()
    assert "forced preemption" in view.value
    assert len(panel.engine.scheduler.running) == 1 and len(panel.engine.scheduler.waiting) == 1
    w["prompt"].value = "oops"
    w["add"].click()
    assert "not added" in message.value and len(panel.engine.seqs) == 2
    w["run"].click()
    assert panel.engine.scheduler.is_finished()
    assert all(s["status"] == "FINISHED" for s in panel.engine.recording["frames"][-1]["seqs"])
    assert "<script" not in view.value and view.value == panel.html
    assert panel.player().recording["frames"] == panel.engine.recording["frames"]
    assert panel.widget is w["box"]


def test_live_panel_adds_a_request_with_n_samples_and_shows_the_fork_and_the_copy():
    panel = LivePanel(num_kvcache_blocks=8, kvcache_block_size=4, lang="en")
    w = panel._build()
    w["prompt"].value, w["max_tokens"].value, w["n"].value = "1 2 3 4 5 6", 3, 2
    w["add"].click()
    w["step"].click()
    assert "forked into seq" in w["view"].value
    w["step"].click()
    assert "copy-on-write" in w["view"].value and "nvv-copy" in w["view"].value
    panel.rebuild(6)  # the replay keeps n
    assert panel.actions[0] == ("add", [1, 2, 3, 4, 5, 6], 3, 2)
    assert any(f["event"].get("copies") for f in panel.engine.recording["frames"])


def view_of(panel: LivePanel) -> str:
    return panel._build()["view"].value


def test_live_panel_rebuild_replays_on_a_new_pool():
    panel = LivePanel(num_kvcache_blocks=8, kvcache_block_size=4, lang="en")
    w = panel._build()
    w["prompt"].value = "1 2 3 4 5 6"
    w["add"].click()
    w["step"].click()
    w["step"].click()
    before = [(f["phase"], f["step"]) for f in panel.engine.recording["frames"]]
    w["pool_size"].value = 3
    w["rebuild"].click()
    recording = panel.engine.recording
    assert recording["num_blocks"] == 3 and "empty pool: 3 blocks" in caption(recording["frames"][0], "en")
    assert [(f["phase"], f["step"]) for f in recording["frames"]] == before  # same actions, new pool
    assert "rebuilt a pool of 3 blocks and replayed 3 actions" in w["message"].value
    assert "empty pool" not in view_of(panel) and view_of(panel).count('class="nvv-cap"') == 1  # the last frame only
    panel.rebuild(1)  # now the request (6 tokens + 4) can never fit: it is skipped, with a message
    assert "skipped" in w["message"].value and panel.engine.seqs == []


def test_panel_shows_buttons_only_in_an_interactive_frontend(monkeypatch):
    for name in ("JPY_SESSION_NAME", "VSCODE_PID", "VSCODE_CWD"):
        monkeypatch.delenv(name, raising=False)
    assert not interactive_frontend()
    monkeypatch.setenv("JPY_SESSION_NAME", "A_visualization.ipynb")
    assert interactive_frontend()


def test_the_package_front_door():
    # Needs tools/tangle.py to write `#| export viz.__init__` to nanovllm/viz/__init__.py.
    import nanovllm.viz as viz

    assert viz.player_html is player_html and viz.Player is Player and viz.Recorder is Recorder
    assert viz.LivePanel is LivePanel and viz.FakeEngine is FakeEngine
    assert sorted(viz.__all__) == viz.__all__ and all(hasattr(viz, name) for name in viz.__all__)


# ---- one language at a time ---------------------------------------------------------------------


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_keep_language_cuts_the_bilingual_output_down_to_exactly_one_language(lang):
    recording = hand_made()
    both = player_html(recording, lang="both", start=3, player_id="p")
    assert keep_language(both, lang) == player_html(recording, lang=lang, start=3, player_id="p")
    assert keep_language(frame_html(recording, 3, "both", since=1), lang) == frame_html(recording, 3, lang, since=1)
    assert keep_language(static_note("both"), lang) == static_note(lang)
    assert "<!--lang:" not in keep_language(both, lang)


def test_one_language_means_no_word_of_the_other():
    recording = shared_prefix_run()[0].recording
    en, zh = player_html(recording, lang="en"), player_html(recording, lang="zh")
    assert not CJK.search(en), CJK.findall(en)[:10]
    for chinese in ("块池", "块表", "等待", "空闲队列", "后退", "播放", "暂停", "单步", "第 1 步", "缓存命中"):
        assert chinese in zh, chinese
    visible_zh = re.sub(r"<style>.*?</style>|<script>.*?</script>|<[^>]+>", " ", zh, flags=re.S)
    for english in ("block pool", "Back", "Play", "Pause", "Step", "prefill:", "free list", "Hover"):
        assert english not in visible_zh, english


def test_no_text_hides_in_attributes_and_no_glyph_needs_a_font():
    html = player_html(hand_made(), lang="both")
    attributes = " ".join(re.findall(r'="([^"]*)"', html))
    assert not CJK.search(attributes) and "block 0" not in attributes
    for glyph in ("⏸", "◀", "▶"):
        assert glyph not in html, glyph
    assert html.count('class="nvv-ico"') == 6  # first, back, play, pause, step, last: drawn, not typed


def test_set_language_changes_the_default_and_lang_text_marks_both():
    assert reading_language() == "both"
    try:
        set_language("zh")
        assert player_html(hand_made(), player_id="x") == player_html(hand_made(), lang="zh", player_id="x")
        assert LivePanel().lang == "zh" and "实时面板" in static_note() and "LivePanel" not in static_note()
    finally:
        set_language("both")
    with pytest.raises(ValueError, match="lang must be one of"):
        set_language("fr")
    assert lang_text("a<b", "甲", "en") == "a&lt;b"
    assert keep_language(lang_text("a", "甲", "both", " / "), "zh") == "甲"
    with pytest.raises(ValueError, match="keeps 'en' or 'zh'"):
        keep_language("", "both")


def test_live_panel_speaks_its_language_and_shows_whole_labels():
    panel = LivePanel(lang="zh")
    w = panel._build()
    assert w["step"].description == "单步" and w["prompt"].description == "提示词"
    assert w["prompt"].style.description_width == "initial" and w["pool_size"].style.description_width == "initial"
    w["step"].click()
    assert "无事可做" in w["message"].value and "nothing" not in w["message"].value
    assert not CJK.search(LivePanel(lang="en")._build()["box"].children[0].children[0].description)


def test_the_panel_is_shown_with_a_hint_that_outlives_its_buttons(monkeypatch: pytest.MonkeyPatch) -> None:
    """In JupyterLab the buttons come with an HTML hint above them: a saved copy reopened later keeps the hint
    (a plain output) where the buttons read "model not found". Elsewhere only the static note, no widget."""
    import IPython.display

    import nanovllm.viz.panel as panel_module

    shown: list[tuple] = []
    # show_panel imports IPython's display when it is called (the server imports viz without IPython installed).
    monkeypatch.setattr(IPython.display, "display", lambda *objects: shown.append(objects))
    panel = LivePanel(num_kvcache_blocks=4, kvcache_block_size=4, lang="zh")
    monkeypatch.setenv("JPY_SESSION_NAME", "read/zh/A_visualization.zh.ipynb")
    panel_module.show_panel(panel)
    (hint, widget), = shown
    assert "重新运行本单元" in hint.data and "model not found" in hint.data and "run this cell" not in hint.data
    assert widget is panel.widget
    shown.clear()
    for name in ("JPY_SESSION_NAME", "VSCODE_PID", "VSCODE_CWD"):
        monkeypatch.delenv(name, raising=False)
    panel_module.show_panel(LivePanel(num_kvcache_blocks=4, kvcache_block_size=4, lang="en"))
    (note,), = shown
    assert "open this chapter in JupyterLab" in note.data


def test_slides_html_plays_ready_made_frames_in_one_language_at_a_time() -> None:
    from nanovllm.viz.player import keep_language, lang_text, slides_html

    def slides(lang: str) -> list[tuple[str, str]]:
        return [(f'<div class="nvv-cap">{lang_text(f"frame {k}", f"第 {k} 帧", lang)}</div>',
                 f"<svg><text>{lang_text('expert', '专家', lang)}</text></svg>") for k in range(3)]

    both = slides_html(slides("both"), lang="both", start=1, player_id="slides")
    assert keep_language(both, "zh") == slides_html(slides("zh"), lang="zh", start=1, player_id="slides")
    assert both.count('class="nvv-frame"') == 3 and 'data-frame="1">' in both and 'data-frame="0" hidden>' in both
    with pytest.raises(ValueError, match="at least one frame"):
        slides_html([], lang="en")
    with pytest.raises(ValueError, match="out of range"):
        slides_html(slides("en"), lang="en", start=3)
