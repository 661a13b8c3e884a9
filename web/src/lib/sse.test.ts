import { describe, expect, it } from "vitest";
import { SseParser, type SseEvent } from "./sse";

const enc = new TextEncoder();

function parseIn(pieces: Uint8Array[]): SseEvent[] {
  const p = new SseParser();
  const out: SseEvent[] = [];
  for (const piece of pieces) out.push(...p.push(piece));
  out.push(...p.end());
  return out;
}

/** Every way of cutting `bytes` in two, and in three at each pair of offsets. */
function* cuts(bytes: Uint8Array): Generator<Uint8Array[]> {
  for (let i = 0; i <= bytes.length; i++) {
    yield [bytes.slice(0, i), bytes.slice(i)];
  }
  for (let i = 0; i <= bytes.length; i += 3) {
    for (let j = i; j <= bytes.length; j += 2) {
      yield [bytes.slice(0, i), bytes.slice(i, j), bytes.slice(j)];
    }
  }
}

// What colibri sends: a role chunk, a prefill comment, reasoning, multi-byte text, usage, [DONE];
// plus the spec's other line ends and fields.
const STREAM =
  'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n' +
  ": prefill 16/32\n\n" +
  'data: {"choices":[{"delta":{"reasoning":"7 + 8 = 15","reasoning_content":"7 + 8 = 15"}}]}\r\n\r\n' +
  'data: {"choices":[{"delta":{"content":"85 — ½ €🙂"}}]}\r\r' +
  "event: note\nid: 7\ndata: line one\ndata:line two\n\n" +
  "data\n\n" +
  "data: [DONE]\n\n";

describe("SseParser", () => {
  const whole = parseIn([enc.encode(STREAM)]);

  it("reads every event of a whole stream", () => {
    expect(whole.map((e) => e.data)).toEqual([
      '{"choices":[{"delta":{"role":"assistant","content":""}}]}',
      '{"choices":[{"delta":{"reasoning":"7 + 8 = 15","reasoning_content":"7 + 8 = 15"}}]}',
      '{"choices":[{"delta":{"content":"85 — ½ €🙂"}}]}',
      "line one\nline two",
      "",
      "[DONE]",
    ]);
    expect(whole[3]).toEqual({ event: "note", data: "line one\nline two", id: "7" });
    expect(whole[0]?.event).toBe("message");
  });

  it("gives the same events however the bytes are cut", () => {
    const bytes = enc.encode(STREAM);
    let n = 0;
    for (const pieces of cuts(bytes)) {
      expect(parseIn(pieces)).toEqual(whole);
      n++;
    }
    expect(n).toBeGreaterThan(bytes.length);
  });

  it("gives the same events fed one byte at a time", () => {
    const bytes = enc.encode(STREAM);
    expect(parseIn(Array.from(bytes, (b) => Uint8Array.of(b)))).toEqual(whole);
  });

  it("drops a last event that never got its blank line, and a leading BOM", () => {
    expect(parseIn([enc.encode("\ufeffdata: a\n\ndata: cut")]).map((e) => e.data)).toEqual(["a"]);
  });
});
