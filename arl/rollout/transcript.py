"""One episode as a readable transcript: what the model said each turn, what the tools answered, and
how the episode ended (``arl.eval --show N``, and the held-out samples a run writes at every
evaluation under ``<output_dir>/transcripts/``)."""
from __future__ import annotations

from ..data.trajectory import Trajectory


def transcript(fmt, t: Trajectory) -> dict:
    """``t`` as a JSON-able dict: ``prompt`` (the rendered prompt text), ``turns`` (one entry per
    segment in order: ``{"role": "assistant", "turn": k, "text", "tokens", "call", "tool_error"}`` for model
    turn k, ``{"role": "observation", "text"}`` for what the template and the env put after it),
    and the episode's ``reward``, ``fault``, ``fault_reason`` and ``truncated``."""
    toks, chunks = list(t.tokens), list(t.chunk_ids)
    segs, i = [], 0
    while i < len(toks):  # maximal runs of equal chunk id: -1 is prompt / observation, k is turn k
        j = i
        while j < len(toks) and chunks[j] == chunks[i]:
            j += 1
        segs.append((int(chunks[i]), fmt.decode(toks[i:j]), j - i))
        i = j
    m = t.metadata
    info, calls = m.get("turn_info", []), m.get("calls", [])
    prompt = segs.pop(0)[1] if segs and segs[0][0] == -1 else ""
    turns = []
    for chunk, text, n_tok in segs:
        if chunk < 0:
            turns.append({"role": "observation", "text": text})
            continue
        ti = info[chunk] if chunk < len(info) else {}
        turns.append({"role": "assistant", "turn": chunk, "text": text, "tokens": n_tok, "call": ti.get("tool"),
                      "tool_error": bool(ti.get("tool_error"))})
    return {"prompt": prompt, "turns": turns, "reward": float(t.reward), "fault": m.get("fault", "none"),
            "fault_reason": m.get("fault_reason"), "truncated": m.get("truncated"), "calls": calls}


def _clip(text: str, width: int) -> str:
    text = text.strip("\n")
    return text if len(text) <= width else text[:width // 2] + f" [... {len(text) - width} chars ...] " + text[-width // 2:]


def format_transcript(row: dict, prompt_tail: int = 240, width: int = 600) -> str:
    """A transcript (``transcript``'s dict, maybe inside an eval row) as plain text: the end of the
    prompt (the task; the system prompt and tool schemas come before it), then each turn."""
    tr = row.get("transcript", row)
    head = f"--- task {row['task']} (seed {row['seed']})" if "task" in row else "---"
    out = [f"{head}: reward {tr['reward']:.3g}, fault {tr['fault']}"
           + (f" ({tr['fault_reason']})" if tr.get("fault_reason") else "")
           + f", truncated {tr['truncated'] or '-'}",
           "[prompt, last chars] " + repr(tr["prompt"][-prompt_tail:])]
    for s in tr["turns"]:
        if s["role"] == "assistant":
            what = f"call {s['call']}" + (" (error)" if s["tool_error"] else "") if s["call"] else \
                ("tool error" if s["tool_error"] else "no call")
            out.append(f"[assistant turn {s['turn']}, {s.get('tokens', '?')} tokens, {what}] {_clip(s['text'], width)!r}")
        else:
            out.append(f"[observation] {_clip(s['text'], width)!r}")
    return "\n".join(out)
