import { describe, expect, it } from "vitest";
import {
  ServerError,
  buildChatRequest,
  chunkParts,
  decodeRate,
  errorFromResponse,
  streamChat,
  type ChatOptions,
  type StreamPart,
} from "./api";
import { parseRoute } from "./route";

const base: ChatOptions = {
  model: "colibri-demo",
  messages: [{ role: "user", content: "What is 37 + 48?" }],
  thinking: true,
  maxTokens: null,
  temperature: 0,
  slot: null,
  slotCount: 1,
};

describe("buildChatRequest", () => {
  it("sends a streaming chat with usage and the reasoning switch, to the same origin", () => {
    const r = buildChatRequest({ baseUrl: "", apiKey: "" }, base);
    expect(r.url).toBe("/v1/chat/completions");
    expect(r.init.method).toBe("POST");
    expect(r.init.headers).toEqual({ "Content-Type": "application/json" });
    expect(JSON.parse(r.init.body)).toEqual({
      model: "colibri-demo",
      messages: [{ role: "user", content: "What is 37 + 48?" }],
      stream: true,
      stream_options: { include_usage: true },
      enable_thinking: true,
      temperature: 0,
    });
  });

  it("adds the Bearer key, max_tokens, and cache_slot only when the server has several slots", () => {
    const conn = { baseUrl: "http://127.0.0.1:8000/", apiKey: "s3cret" };
    const one = buildChatRequest(conn, { ...base, slot: 0, maxTokens: 64, thinking: false });
    expect(one.url).toBe("http://127.0.0.1:8000/v1/chat/completions");
    expect(one.init.headers.Authorization).toBe("Bearer s3cret");
    const body = JSON.parse(one.init.body) as Record<string, unknown>;
    expect(body.max_tokens).toBe(64);
    expect(body.enable_thinking).toBe(false);
    expect("cache_slot" in body).toBe(false);
    const two = JSON.parse(buildChatRequest(conn, { ...base, slot: 1, slotCount: 2 }).init.body) as Record<string, unknown>;
    expect(two.cache_slot).toBe(1);
    const any = JSON.parse(buildChatRequest(conn, { ...base, slot: null, slotCount: 2 }).init.body) as Record<string, unknown>;
    expect("cache_slot" in any).toBe(false);
  });
});

describe("chunkParts", () => {
  it("keeps reasoning apart from content and takes it once", () => {
    expect(chunkParts('{"choices":[{"delta":{"reasoning":"r","reasoning_content":"r"},"finish_reason":null}]}')).toEqual([
      { kind: "reasoning", text: "r" },
    ]);
    expect(chunkParts('{"choices":[{"delta":{"content":"85"},"finish_reason":null}]}')).toEqual([{ kind: "content", text: "85" }]);
    expect(chunkParts('{"choices":[{"delta":{},"finish_reason":"length"}]}')).toEqual([{ kind: "finish", reason: "length" }]);
    expect(chunkParts('{"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":4,"total_tokens":13}}')).toEqual([
      { kind: "usage", usage: { prompt_tokens: 9, completion_tokens: 4 } },
    ]);
    expect(chunkParts("[DONE]")).toEqual([]);
  });

  it("turns an error event into the server's message", () => {
    const [part] = chunkParts('{"error":{"message":"generation failed: RuntimeError: x","type":"server_error","param":null,"code":"internal_error"}}');
    expect(part?.kind).toBe("error");
    if (part?.kind === "error") {
      expect(part.error.message).toBe("generation failed: RuntimeError: x");
      expect(part.error.code).toBe("internal_error");
    }
  });
});

describe("errorFromResponse", () => {
  it("uses the envelope's words, and Retry-After on a 429", () => {
    const e = errorFromResponse(429, '{"error":{"message":"The queue is full","type":"rate_limit_error","code":"queue_full"}}', "3");
    expect(e).toBeInstanceOf(ServerError);
    expect(e.message).toBe("The queue is full (retry after 3 s)");
    expect(e.status).toBe(429);
    expect(e.code).toBe("queue_full");
    expect(errorFromResponse(502, "Bad gateway\n", null).message).toBe("Bad gateway");
    expect(errorFromResponse(500, "", null).message).toBe("HTTP 500");
  });
});

describe("streamChat", () => {
  // A Response built by the platform's own fetch types: the code under test is the parsing of
  // its body, cut into odd pieces, and the reading of its headers.
  function respond(body: string, init: ResponseInit, pieceSize: number): typeof fetch {
    const bytes = new TextEncoder().encode(body);
    return async () =>
      new Response(
        new ReadableStream<Uint8Array>({
          start(c) {
            for (let i = 0; i < bytes.length; i += pieceSize) c.enqueue(bytes.slice(i, i + pieceSize));
            c.close();
          },
        }),
        init,
      );
  }
  const sse =
    'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n' +
    'data: {"choices":[{"delta":{"reasoning":"3 + 4 + 1 = 8.","reasoning_content":"3 + 4 + 1 = 8."}}]}\n\n' +
    'data: {"choices":[{"delta":{"content":"85"}}]}\n\n' +
    'data: {"choices":[{"delta":{},"finish_reason":"stop"}]}\n\n' +
    'data: {"choices":[],"usage":{"prompt_tokens":12,"completion_tokens":20}}\n\n' +
    "data: [DONE]\n\n";

  it("delivers the parts and the queue wait, for any piece size", async () => {
    for (const size of [1, 2, 7, 64, 4096]) {
      const parts: StreamPart[] = [];
      let wait: number | null = -1;
      const req = buildChatRequest({ baseUrl: "", apiKey: "" }, base);
      await streamChat(
        req,
        new AbortController().signal,
        (s) => (wait = s.queueWaitMs),
        (p) => parts.push(p),
        respond(sse, { status: 200, headers: { "x-colibri-queue-wait-ms": "12" } }, size),
      );
      expect(wait).toBe(12);
      expect(parts).toEqual([
        { kind: "reasoning", text: "3 + 4 + 1 = 8." },
        { kind: "content", text: "85" },
        { kind: "finish", reason: "stop" },
        { kind: "usage", usage: { prompt_tokens: 12, completion_tokens: 20 } },
      ]);
    }
  });

  it("rejects with the server's own error on a non-2xx answer", async () => {
    const req = buildChatRequest({ baseUrl: "", apiKey: "" }, base);
    const body = '{"error":{"message":"Missing or invalid API key.","type":"invalid_request_error","code":"invalid_api_key"}}';
    await expect(
      streamChat(req, new AbortController().signal, () => {}, () => {}, respond(body, { status: 401 }, 5)),
    ).rejects.toMatchObject({ status: 401, code: "invalid_api_key", message: "Missing or invalid API key." });
  });
});

describe("decodeRate and routes", () => {
  it("times decode from the first token", () => {
    expect(decodeRate(1, 0, 1000)).toBeNull();
    expect(decodeRate(11, 500, 1500)).toBe(10);
    expect(decodeRate(5, null, 1000)).toBeNull();
  });
  it("maps hashes to pages, chat by default", () => {
    expect(parseRoute("")).toBe("chat");
    expect(parseRoute("#/system")).toBe("system");
    expect(parseRoute("#/nope")).toBe("chat");
  });
});

describe("profile maths", () => {
  const turn = {
    prefill_tokens: 15, decode_tokens: 34, prefill_s: 0.5, decode_s: 1.5, prefill_tok_s: 30, decode_tok_s: 22.7,
    io_wait_s: 0.2, expert_matmul_s: 1.0, attention_s: 0.4, lm_head_s: 0.3, other_s: 0.1, bytes_read: 1000,
    cache_hits: 30, cache_misses: 10, cache_hit_rate: 0.75, prefetch_reads: 0, prefetch_used: 0, prefetch_recall: 0,
  };
  it("splits a turn's wall time into its phases", async () => {
    const { phaseShares } = await import("./api");
    const shares = phaseShares(turn);
    expect(shares.map((s) => s.phase)).toEqual(["io_wait_s", "expert_matmul_s", "attention_s", "lm_head_s", "other_s"]);
    expect(shares.map((s) => s.share)).toEqual([0.1, 0.5, 0.2, 0.15, 0.05]);
    expect(shares.reduce((a, s) => a + s.share, 0)).toBeCloseTo(1, 12);
    expect(phaseShares({ ...turn, prefill_s: 0, decode_s: 0 }).every((s) => s.share === 0)).toBe(true);
  });
  it("totals turns, with the hit rate over all lookups", async () => {
    const { profileTotals } = await import("./api");
    const all = profileTotals([turn, { ...turn, cache_hits: 0, cache_misses: 40, decode_tokens: 6, decode_s: 0.5 }]);
    expect(all).toMatchObject({ turns: 2, prefillTokens: 30, decodeTokens: 40, bytesRead: 2000 });
    expect(all.hitRate).toBeCloseTo(30 / 80, 12);
    expect(all.decodeTokS).toBeCloseTo(40 / 2, 12);
    expect(profileTotals([{ ...turn, cache_hits: 0, cache_misses: 0 }]).hitRate).toBeNull();
    expect(profileTotals([])).toMatchObject({ turns: 0, hitRate: null, decodeTokS: null, readBusy: null, overlapped: null });
  });
  it("takes the reading overlapped with compute as read busy time minus I/O wait", async () => {
    const { readOverlap, profileTotals } = await import("./api");
    expect(readOverlap(turn)).toBeNull(); // a server that reports no read busy time
    const o = readOverlap({ ...turn, read_busy_s: 0.5 });
    expect(o?.overlapped).toBeCloseTo(0.3, 12);
    expect(o?.share).toBeCloseTo(0.6, 12);
    // Waiting longer than reads were in flight (a free slot, or a shared pass): no overlap.
    expect(readOverlap({ ...turn, read_busy_s: 0.1 })).toEqual({ busy: 0.1, wait: 0.2, overlapped: 0, share: 0 });
    expect(readOverlap({ ...turn, read_busy_s: 0, io_wait_s: 0 })).toEqual({ busy: 0, wait: 0, overlapped: 0, share: null });
    const all = profileTotals([{ ...turn, read_busy_s: 0.5 }, { ...turn, read_busy_s: 0.1 }, turn]);
    expect(all.readBusy).toBeCloseTo(0.6, 12);
    expect(all.overlapped).toBeCloseTo(0.3, 12);
  });
});

describe("expertCells", () => {
  it("lays the map out row-major with log heat and the last turn's experts", async () => {
    const { expertCells } = await import("./api");
    const cells = expertCells({
      experts: 3,
      placement: "resident",
      turns: 4,
      layers: [
        { layer: 1, counts: [0, 1, 255], routed: [2] },
        { layer: 2, counts: [15, 3], routed: [0, 1] },
      ],
    });
    expect(cells.map((c) => [c.layer, c.expert])).toEqual([[1, 0], [1, 1], [1, 2], [2, 0], [2, 1], [2, 2]]);
    expect(cells.map((c) => c.count)).toEqual([0, 1, 255, 15, 3, 0]);
    expect(cells.map((c) => c.heat)).toEqual([0, 1 / 8, 1, 4 / 8, 2 / 8, 0]);
    expect(cells.filter((c) => c.routed).map((c) => `${c.layer}:${c.expert}`)).toEqual(["1:2", "2:0", "2:1"]);
    expect(expertCells({ experts: 2, placement: "resident", turns: 0, layers: [{ layer: 1, counts: [0, 0], routed: [] }] }).every((c) => c.heat === 0)).toBe(true);
  });

  it("decodes each layer's tiers, one letter per expert, and counts them for the legend", async () => {
    const { expertCells, decodeTiers, tierCounts } = await import("./api");
    expect(decodeTiers("rpcd", 4)).toEqual(["resident", "pinned", "cached", "disk"]);
    // Short, missing or unknown letters: not reported (an older server sends no tiers).
    expect(decodeTiers("px", 3)).toEqual(["pinned", "unknown", "unknown"]);
    expect(decodeTiers(undefined, 2)).toEqual(["unknown", "unknown"]);
    expect(decodeTiers("", 0)).toEqual([]);
    const cells = expertCells({
      experts: 4,
      placement: "cached",
      turns: 1,
      layers: [
        { layer: 1, counts: [9, 0, 3, 1], routed: [0, 2], tiers: "pdcd" },
        { layer: 2, counts: [0, 7, 0, 0], routed: [1], tiers: "dpdd" },
      ],
    });
    expect(cells.map((c) => c.tier)).toEqual(["pinned", "disk", "cached", "disk", "disk", "pinned", "disk", "disk"]);
    expect(cells.filter((c) => c.routed).map((c) => `${c.layer}:${c.expert}:${c.tier}`)).toEqual(["1:0:pinned", "1:2:cached", "2:1:pinned"]);
    // Legend order: pinned, RAM cache, resident, disk, not reported; tiers without cells left out.
    expect(tierCounts(cells)).toEqual([
      ["pinned", 2],
      ["cached", 1],
      ["disk", 5],
    ]);
    const resident = expertCells({ experts: 2, placement: "resident", turns: 0, layers: [{ layer: 3, counts: [1, 2], routed: [], tiers: "rr" }] });
    expect(tierCounts(resident)).toEqual([["resident", 2]]);
  });
});

describe("expertBudget", () => {
  it("is the cache's slots times its record size, with the pinned count; null without a cache", async () => {
    const { expertBudget } = await import("./api");
    expect(expertBudget({ slots: 5, pinned: 2, record_size: 4096, reads: 9, io: "io_uring" })).toEqual({ slots: 5, pinned: 2, bytes: 20480 });
    expect(expertBudget(null)).toBeNull();
    expect(expertBudget({ slots: 5, pinned: 2 })).toBeNull();
  });
});

describe("loadedRam", () => {
  it("sums the RAM of the loaded models only (cold, loading and failed ones take none of the budget)", async () => {
    const { loadedRam } = await import("./api");
    expect(
      loadedRam([
        { id: "a", state: "loaded", ram_bytes: 100 },
        { id: "b", state: "cold", ram_bytes: 40 },
        { id: "c", state: "loaded", ram_bytes: 7 },
        { id: "d", state: "loading", ram_bytes: 9 },
        { id: "e", state: "failed", ram_bytes: 3, error: "x" },
      ]),
    ).toBe(107);
    expect(loadedRam([])).toBe(0);
  });
});
