// The dashboard's one contract with the server: request building, the chat stream, /health and
// /v1/models. Pure helpers are exported for the unit tests.

import { SseParser } from "./sse";

export interface ChatMessage {
  role: "system" | "user" | "assistant";
  content: string;
}

export interface Connection {
  /** "" for the page's own origin (the server that served it). */
  baseUrl: string;
  /** Kept in memory only; "" when the server has no key. */
  apiKey: string;
}

export interface ChatOptions {
  model: string;
  messages: ChatMessage[];
  thinking: boolean;
  maxTokens: number | null;
  temperature: number;
  /** A KV slot, sent only when the server has more than one. */
  slot: number | null;
  slotCount: number;
}

export interface BuiltRequest {
  url: string;
  init: { method: "POST"; headers: Record<string, string>; body: string };
}

export function authHeaders(conn: Connection): Record<string, string> {
  return conn.apiKey ? { Authorization: `Bearer ${conn.apiKey}` } : {};
}

export function endpoint(conn: Connection, path: string): string {
  return conn.baseUrl.replace(/\/+$/, "") + path;
}

export function buildChatRequest(conn: Connection, opts: ChatOptions): BuiltRequest {
  const body: Record<string, unknown> = {
    model: opts.model,
    messages: opts.messages.map((m) => ({ role: m.role, content: m.content })),
    stream: true,
    stream_options: { include_usage: true },
    enable_thinking: opts.thinking,
    temperature: opts.temperature,
  };
  if (opts.maxTokens !== null) body.max_tokens = opts.maxTokens;
  if (opts.slot !== null && opts.slotCount > 1) body.cache_slot = opts.slot;
  return {
    url: endpoint(conn, "/v1/chat/completions"),
    init: {
      method: "POST",
      headers: { "Content-Type": "application/json", ...authHeaders(conn) },
      body: JSON.stringify(body),
    },
  };
}

/** An error as the server put it: its message and code, and Retry-After for a 429. */
export class ServerError extends Error {
  constructor(
    message: string,
    readonly status: number | null,
    readonly code: string | null,
  ) {
    super(message);
    this.name = "ServerError";
  }
}

function isRecord(v: unknown): v is Record<string, unknown> {
  return typeof v === "object" && v !== null && !Array.isArray(v);
}

/** The message of an OpenAI or Anthropic error envelope, else null. */
/** A failed request in words: the server's status and message, else the error itself. */
export function errorText(e: unknown): string {
  return e instanceof ServerError ? `${e.status ?? ""} ${e.message}`.trim() : String(e);
}

export function envelopeMessage(body: unknown): { message: string; code: string | null } | null {
  if (!isRecord(body) || !isRecord(body.error)) return null;
  const err = body.error;
  if (typeof err.message !== "string") return null;
  const code = typeof err.code === "string" ? err.code : typeof err.type === "string" ? err.type : null;
  return { message: err.message, code };
}

/** `fetchImpl(url, init)`; a network failure becomes ServerError "unreachable" (an abort through
 * `init.signal` stays the abort). */
export async function fetchOrUnreachable(fetchImpl: typeof fetch, url: string, init: RequestInit): Promise<Response> {
  try {
    return await fetchImpl(url, init);
  } catch (e) {
    if (init.signal?.aborted) throw e;
    throw new ServerError(`cannot reach the server: ${e instanceof Error ? e.message : String(e)}`, null, "unreachable");
  }
}

export function errorFromResponse(status: number, text: string, retryAfter: string | null): ServerError {
  let parsed: unknown = null;
  try {
    parsed = JSON.parse(text);
  } catch {
    parsed = null;
  }
  const env = envelopeMessage(parsed);
  let message = env ? env.message : text.trim() || `HTTP ${status}`;
  if (status === 429 && retryAfter) message += ` (retry after ${retryAfter} s)`;
  return new ServerError(message, status, env ? env.code : null);
}

export interface Usage {
  prompt_tokens: number;
  completion_tokens: number;
}

export type StreamPart =
  | { kind: "content"; text: string }
  | { kind: "reasoning"; text: string }
  | { kind: "finish"; reason: string }
  | { kind: "usage"; usage: Usage }
  | { kind: "error"; error: ServerError };

/** What one `data:` payload of a chat stream says ("[DONE]" says nothing). */
export function chunkParts(data: string): StreamPart[] {
  if (data === "[DONE]") return [];
  let chunk: unknown;
  try {
    chunk = JSON.parse(data);
  } catch {
    return [{ kind: "error", error: new ServerError(`unreadable stream data: ${data}`, null, null) }];
  }
  const env = envelopeMessage(chunk);
  if (env) return [{ kind: "error", error: new ServerError(env.message, null, env.code) }];
  if (!isRecord(chunk)) return [];
  const parts: StreamPart[] = [];
  const choices = Array.isArray(chunk.choices) ? chunk.choices : [];
  for (const choice of choices) {
    if (!isRecord(choice)) continue;
    const delta = isRecord(choice.delta) ? choice.delta : {};
    // The server sends reasoning under two names with the same text: take one.
    const reasoning = delta.reasoning_content ?? delta.reasoning;
    if (typeof reasoning === "string" && reasoning) parts.push({ kind: "reasoning", text: reasoning });
    if (typeof delta.content === "string" && delta.content) parts.push({ kind: "content", text: delta.content });
    if (typeof choice.finish_reason === "string") parts.push({ kind: "finish", reason: choice.finish_reason });
  }
  const usage = chunk.usage;
  if (isRecord(usage) && typeof usage.completion_tokens === "number" && typeof usage.prompt_tokens === "number") {
    parts.push({ kind: "usage", usage: { prompt_tokens: usage.prompt_tokens, completion_tokens: usage.completion_tokens } });
  }
  return parts;
}

export interface StreamStart {
  queueWaitMs: number | null;
  requestId: string | null;
}

/**
 * Streams one chat turn. Aborting `signal` closes the connection, which the server takes as the
 * client gone: it stops the generation after the token in flight and frees the KV slot.
 * Resolves when the stream ends; rejects with ServerError (or the AbortError on Stop).
 */
export async function streamChat(
  req: BuiltRequest,
  signal: AbortSignal,
  onStart: (s: StreamStart) => void,
  onPart: (p: StreamPart) => void,
  fetchImpl: typeof fetch = fetch,
): Promise<void> {
  const res = await fetchOrUnreachable(fetchImpl, req.url, { ...req.init, signal });
  if (!res.ok) {
    throw errorFromResponse(res.status, await res.text(), res.headers.get("retry-after"));
  }
  const wait = res.headers.get("x-colibri-queue-wait-ms");
  onStart({ queueWaitMs: wait === null ? null : Number(wait), requestId: res.headers.get("x-request-id") });
  if (!res.body) throw new ServerError("the response has no body", res.status, null);
  const reader = res.body.getReader();
  const parser = new SseParser();
  const emit = (events: ReturnType<SseParser["push"]>) => {
    for (const ev of events) for (const part of chunkParts(ev.data)) onPart(part);
  };
  for (;;) {
    const { done, value } = await reader.read();
    if (done) break;
    emit(parser.push(value));
  }
  emit(parser.end());
}

export interface Health {
  status: string;
  model?: string;
  active?: number;
  queued?: number;
  capacity?: number;
  max_queue?: number;
  admitted?: number;
  completed?: number;
  failed?: number;
  rejected?: number;
  timed_out?: number;
  cancelled?: number;
  context_length?: number;
  kv_bytes_per_token?: number;
  prefill?: { slot: number | null; prompt_tokens: number; prompt_tokens_done: number }[];
  error?: string;
  /** `--ram-gb` in bytes (null: no budget). */
  ram_budget_bytes?: number | null;
  /** With a catalog of several models: each one's state and the RAM it counts. */
  models?: ModelState[];
}

export interface ModelState {
  id: string;
  state: "loaded" | "loading" | "cold" | "failed";
  ram_bytes: number;
  error?: string;
}

/** RAM the loaded models count against the budget (/health's `models`). */
export function loadedRam(models: ModelState[]): number {
  return models.filter((m) => m.state === "loaded").reduce((sum, m) => sum + m.ram_bytes, 0);
}

export interface ModelCard {
  id: string;
  created: number;
  owned_by: string;
  max_model_len?: number;
}

async function getJson(conn: Connection, path: string, signal?: AbortSignal): Promise<{ status: number; body: unknown }> {
  const res = await fetchOrUnreachable(fetch, endpoint(conn, path), { headers: authHeaders(conn), ...(signal ? { signal } : {}) });
  const text = await res.text();
  // /health answers 503 with a body when the engine failed: still a snapshot to show.
  if (!res.ok && !(path === "/health" && res.status === 503)) {
    throw errorFromResponse(res.status, text, res.headers.get("retry-after"));
  }
  return { status: res.status, body: JSON.parse(text) as unknown };
}

export async function fetchHealth(conn: Connection, signal?: AbortSignal): Promise<Health> {
  const { body } = await getJson(conn, "/health", signal);
  return body as Health;
}

export async function fetchModels(conn: Connection, signal?: AbortSignal): Promise<ModelCard[]> {
  const { body } = await getJson(conn, "/v1/models", signal);
  if (!isRecord(body) || !Array.isArray(body.data)) return [];
  return body.data as ModelCard[];
}

/** Decode speed: tokens after the first over the time since the first. */
export function decodeRate(tokens: number, firstAt: number | null, now: number): number | null {
  if (firstAt === null || tokens < 2 || now <= firstAt) return null;
  return ((tokens - 1) * 1000) / (now - firstAt);
}

export interface EngineInfo {
  model: string;
  chat_family: string;
  // Where the chat template comes from: the checkpoint's, colibri's built-in one, or none.
  chat_template?: "model" | "builtin" | null;
  architecture?: string;
  quantization?: string;
  hidden_size?: number;
  num_layers?: number;
  num_experts?: number;
  experts_per_token?: number;
  vocab_size?: number;
  context_length?: number;
  model_context_length?: number;
  kv_dtype?: string;
  kv_bytes_per_token?: number;
  kernel?: string;
  kernel_prefetch?: string;
  kernel_prefetch_decode?: string;
  kernel_avx_vnni?: boolean;
  threads?: number;
  prefill_chunk?: number;
  kv_slots?: number;
  expert_cache: Record<string, unknown> | null;
}

/** The RAM budget of the expert cache from its counters (`expert_cache` of /v1/colibri/info or
 * /v1/colibri/profile): slots (experts it holds at once), the pinned ones among them, and the
 * bytes (slots x record size); null without a cache or when a figure is missing. */
export function expertBudget(cache: Record<string, unknown> | null): { slots: number; pinned: number; bytes: number } | null {
  if (cache === null) return null;
  const { slots, pinned, record_size: size } = cache;
  if (typeof slots !== "number" || typeof pinned !== "number" || typeof size !== "number") return null;
  return { slots, pinned, bytes: slots * size };
}

export async function fetchInfo(conn: Connection, signal?: AbortSignal): Promise<EngineInfo> {
  const { body } = await getJson(conn, "/v1/colibri/info", signal);
  return body as EngineInfo;
}

/** One generation's profile, as the engine reports it (`Engine.last_profile()`). */
export interface TurnProfile {
  prefill_tokens: number;
  decode_tokens: number;
  prefill_s: number;
  decode_s: number;
  prefill_tok_s: number;
  decode_tok_s: number;
  io_wait_s: number;
  expert_matmul_s: number;
  attention_s: number;
  lm_head_s: number;
  other_s: number;
  bytes_read: number;
  /** Read busy time: wall seconds of the turn during which at least one expert read was in
   * flight (overlapping reads count once). Absent from servers before it was counted. */
  read_busy_s?: number;
  cache_hits: number;
  cache_misses: number;
  cache_hit_rate: number;
  prefetch_reads: number;
  prefetch_used: number;
  prefetch_recall: number;
}

export interface Profile {
  turns: TurnProfile[];
  last_routed_experts: number[][];
  expert_cache: Record<string, number | string | boolean | null> | null;
}

export async function fetchProfile(conn: Connection, signal?: AbortSignal): Promise<Profile> {
  const { body } = await getJson(conn, "/v1/colibri/profile", signal);
  return body as Profile;
}

export const PHASES = [
  ["io_wait_s", "I/O wait"],
  ["expert_matmul_s", "expert matmul"],
  ["attention_s", "attention"],
  ["lm_head_s", "LM head"],
  ["other_s", "other"],
] as const;
export type Phase = (typeof PHASES)[number][0];

/** Where a turn's time went: each phase's seconds and share of the turn (prefill + decode). */
export function phaseShares(t: TurnProfile): { phase: Phase; label: string; seconds: number; share: number }[] {
  const wall = t.prefill_s + t.decode_s;
  return PHASES.map(([phase, label]) => {
    const seconds = Math.max(0, t[phase]);
    return { phase, label, seconds, share: wall > 0 ? seconds / wall : 0 };
  });
}

/** Expert reading overlapped with compute in a turn: read busy time (wall time with at least one
 * expert read in flight) minus I/O wait (time the compute stood blocked waiting for reads),
 * never below 0 (the wait can exceed the busy time when it waited for a free cache slot rather
 * than a read, or when a pass shared by streams stepped together counts whole in each one's
 * wait). `share`: overlapped / busy (null with no read). null when the server reports no read
 * busy time. */
export function readOverlap(t: Pick<TurnProfile, "read_busy_s" | "io_wait_s">): {
  busy: number;
  wait: number;
  overlapped: number;
  share: number | null;
} | null {
  if (typeof t.read_busy_s !== "number") return null;
  const busy = Math.max(0, t.read_busy_s);
  const wait = Math.max(0, t.io_wait_s);
  const overlapped = Math.max(0, busy - wait);
  return { busy, wait, overlapped, share: busy > 0 ? overlapped / busy : null };
}

/** Totals over turns: tokens, seconds, bytes read and the cache hit rate over all lookups. */
export function profileTotals(turns: TurnProfile[]): {
  turns: number;
  prefillTokens: number;
  decodeTokens: number;
  seconds: number;
  bytesRead: number;
  hitRate: number | null;
  decodeTokS: number | null;
  /** Read busy and overlapped seconds summed over the turns that report them (null: none does). */
  readBusy: number | null;
  overlapped: number | null;
} {
  let prefillTokens = 0, decodeTokens = 0, seconds = 0, decodeSeconds = 0, bytesRead = 0, hits = 0, misses = 0;
  let readBusy: number | null = null, overlapped: number | null = null;
  for (const t of turns) {
    const o = readOverlap(t);
    if (o !== null) {
      readBusy = (readBusy ?? 0) + o.busy;
      overlapped = (overlapped ?? 0) + o.overlapped;
    }
    prefillTokens += t.prefill_tokens;
    decodeTokens += t.decode_tokens;
    seconds += t.prefill_s + t.decode_s;
    decodeSeconds += t.decode_s;
    bytesRead += t.bytes_read;
    hits += t.cache_hits;
    misses += t.cache_misses;
  }
  return {
    turns: turns.length,
    prefillTokens,
    decodeTokens,
    seconds,
    bytesRead,
    hitRate: hits + misses > 0 ? hits / (hits + misses) : null,
    decodeTokS: decodeSeconds > 0 ? decodeTokens / decodeSeconds : null,
    readBusy,
    overlapped,
  };
}

/** Where an expert lives now: in RAM for the whole run with no expert cache ("resident"), in the
 * cache's pinned part ("pinned"), in its LRU part ("cached"), or only in the experts file
 * ("disk"); "unknown" when the server does not say (an older server). */
export type Tier = "resident" | "pinned" | "cached" | "disk" | "unknown";

export const TIERS: readonly Tier[] = ["pinned", "cached", "resident", "disk", "unknown"];

const TIER_LETTERS: Record<string, Tier> = { r: "resident", p: "pinned", c: "cached", d: "disk" };

/** A layer's `tiers` string (one letter per expert: r, p, c, d) as `experts` tiers; a missing
 * string, a short one or an unknown letter gives "unknown" for those experts. */
export function decodeTiers(letters: string | undefined, experts: number): Tier[] {
  const out: Tier[] = [];
  for (let e = 0; e < experts; e++) out.push(TIER_LETTERS[letters?.charAt(e) ?? ""] ?? "unknown");
  return out;
}

/** Routing of one MoE layer: selections per expert since the heat began, the experts the last
 * turn routed to, and where each expert is now. */
export interface ExpertLayer {
  layer: number;
  counts: number[];
  routed: number[];
  /** One letter per expert: r resident, p pinned, c RAM cache, d disk (absent: older server). */
  tiers?: string;
}

export interface ExpertMap {
  experts: number;
  layers: ExpertLayer[];
  /** "resident": every expert in RAM; "cached": a RAM cache over the experts file. */
  placement: "resident" | "cached";
  /** Generations profiled so far: a new value means a new last turn. */
  turns: number;
}

export async function fetchExperts(conn: Connection, signal?: AbortSignal): Promise<ExpertMap> {
  const { body } = await getJson(conn, "/v1/colibri/experts", signal);
  return body as ExpertMap;
}

export interface ExpertCell {
  layer: number;
  expert: number;
  count: number;
  /** 0..1: log-scaled selections against the hottest expert of the map. */
  heat: number;
  routed: boolean;
  tier: Tier;
}

/** The map's cells, row-major (layers x experts), heat on a log scale so that the cold
 * experts of a layer stay told apart from the never-used ones. */
export function expertCells(map: ExpertMap): ExpertCell[] {
  let max = 0;
  for (const l of map.layers) for (const c of l.counts) max = Math.max(max, c);
  const scale = Math.log2(max + 1);
  const cells: ExpertCell[] = [];
  for (const l of map.layers) {
    const routed = new Set(l.routed);
    const tiers = decodeTiers(l.tiers, map.experts);
    for (let e = 0; e < map.experts; e++) {
      const count = l.counts[e] ?? 0;
      cells.push({
        layer: l.layer,
        expert: e,
        count,
        heat: scale > 0 ? Math.log2(count + 1) / scale : 0,
        routed: routed.has(e),
        tier: tiers[e] ?? "unknown",
      });
    }
  }
  return cells;
}

/** How many cells each tier has (tiers without cells left out), in legend order. */
export function tierCounts(cells: readonly ExpertCell[]): [Tier, number][] {
  const n = new Map<Tier, number>();
  for (const c of cells) n.set(c.tier, (n.get(c.tier) ?? 0) + 1);
  return TIERS.filter((t) => n.has(t)).map((t) => [t, n.get(t) ?? 0]);
}
