import { useCallback, useEffect, useRef, useState, type FormEvent, type KeyboardEvent } from "react";
import { CopyButton, Markdown } from "../components/Markdown";
import {
  ServerError,
  buildChatRequest,
  decodeRate,
  streamChat,
  type ChatMessage,
  type Connection,
  type Usage,
} from "../lib/api";
import {
  deleteConversation,
  listConversations,
  saveConversation,
  searchConversations,
  titleOf,
  type Conversation,
} from "../lib/history";
import { download, toJson, toMarkdown, type TranscriptTurn } from "../lib/transcript";

interface Stats {
  startedAt: number;
  firstAt: number | null;
  lastAt: number | null;
  pieces: number;
  usage: Usage | null;
  queueWaitMs: number | null;
  finish: string | null;
  stopped: boolean;
}

interface Turn {
  id: number;
  role: "user" | "assistant";
  content: string;
  reasoning: string;
  reasoningOpen: boolean;
  streaming: boolean;
  error: string | null;
  stats: Stats | null;
}

export interface ServerFacts {
  model: string | null;
  contextLength: number | null;
  slotCount: number;
}

let nextId = 1;

function newConversationId(): string {
  return typeof crypto.randomUUID === "function" ? crypto.randomUUID() : `${Date.now()}-${Math.random()}`;
}

function toTranscript(t: Turn): TranscriptTurn {
  return { role: t.role, content: t.content, reasoning: t.reasoning, finish: t.stats?.finish ?? null };
}

function fromTranscript(t: TranscriptTurn): Turn {
  return { id: nextId++, role: t.role, content: t.content, reasoning: t.reasoning, reasoningOpen: false, streaming: false, error: null, stats: null };
}

function fileStem(title: string): string {
  return title.replace(/[^\p{L}\p{N}]+/gu, "-").replace(/^-+|-+$/g, "").slice(0, 40) || "conversation";
}

function fmtMs(ms: number): string {
  return ms < 1000 ? `${Math.round(ms)} ms` : `${(ms / 1000).toFixed(2)} s`;
}

function StatsLine({ stats, streaming, now }: { stats: Stats; streaming: boolean; now: number }) {
  const tokens = stats.usage?.completion_tokens ?? stats.pieces;
  // While streaming, the clock ticks every 250 ms: never behind the last token.
  const end = streaming ? Math.max(now, stats.lastAt ?? now) : (stats.lastAt ?? now);
  const rate = decodeRate(tokens, stats.firstAt, end);
  const items: string[] = [];
  if (stats.firstAt !== null) items.push(`TTFT ${fmtMs(stats.firstAt - stats.startedAt)}`);
  if (rate !== null) items.push(`${rate.toFixed(1)} tok/s`);
  items.push(`${tokens} tokens${stats.usage || streaming ? "" : " (approx.)"}`);
  if (stats.queueWaitMs !== null) items.push(`queue ${fmtMs(stats.queueWaitMs)}`);
  return (
    <div className="stats" data-testid="stats">
      {items.join(" · ")}
      {stats.finish === "length" && (
        <span className="badge warn" title="the reply hit its token budget (finish_reason: length)">
          truncated
        </span>
      )}
      {stats.stopped && <span className="badge">stopped</span>}
    </div>
  );
}

export function Chat({ conn, facts }: { conn: Connection; facts: ServerFacts }) {
  const [turns, setTurns] = useState<Turn[]>([]);
  const [draft, setDraft] = useState("");
  const [thinking, setThinking] = useState(true);
  const [maxTokens, setMaxTokens] = useState("");
  const [temperature, setTemperature] = useState("0");
  const [slot, setSlot] = useState<number | null>(null);
  const [now, setNow] = useState(() => performance.now());
  const [convId, setConvId] = useState(newConversationId);
  const [saved, setSaved] = useState<Conversation[]>([]);
  const [query, setQuery] = useState("");
  const [historyError, setHistoryError] = useState<string | null>(null);
  const [editingId, setEditingId] = useState<number | null>(null);
  const dirtyRef = useRef(false);
  const promptRef = useRef<HTMLTextAreaElement | null>(null);
  const abortRef = useRef<AbortController | null>(null);
  const logRef = useRef<HTMLDivElement | null>(null);
  const stickRef = useRef(true);
  const busy = turns.some((t) => t.streaming);

  // A clock for the live tok/s while a reply streams.
  useEffect(() => {
    if (!busy) return;
    const timer = window.setInterval(() => setNow(performance.now()), 250);
    return () => window.clearInterval(timer);
  }, [busy]);

  // Follow the reply unless the reader scrolled up.
  useEffect(() => {
    const el = logRef.current;
    if (el && stickRef.current) el.scrollTop = el.scrollHeight;
  }, [turns]);

  const refreshSaved = useCallback(() => {
    listConversations()
      .then((all) => {
        setSaved(all);
        setHistoryError(null);
      })
      .catch((e: unknown) => setHistoryError(`history unavailable: ${e instanceof Error ? e.message : String(e)}`));
  }, []);

  useEffect(() => refreshSaved(), [refreshSaved]);

  // A conversation is saved once a reply has ended (never in the middle of one).
  useEffect(() => {
    if (busy || !dirtyRef.current || turns.length === 0) return;
    dirtyRef.current = false;
    const kept = turns.map(toTranscript);
    saveConversation({ id: convId, title: titleOf(kept), model: facts.model, updatedAt: Date.now(), turns: kept })
      .then(refreshSaved)
      .catch((e: unknown) => setHistoryError(`not saved: ${e instanceof Error ? e.message : String(e)}`));
  }, [busy, turns, convId, facts.model, refreshSaved]);

  const update = useCallback((id: number, f: (t: Turn) => Turn) => {
    setTurns((ts) => ts.map((t) => (t.id === id ? f(t) : t)));
  }, []);

  const stop = useCallback(() => abortRef.current?.abort(), []);

  const send = useCallback(
    async (history: Turn[]) => {
      const model = facts.model;
      const reply: Turn = {
        id: nextId++,
        role: "assistant",
        content: "",
        reasoning: "",
        reasoningOpen: true,
        streaming: true,
        error: null,
        stats: null,
      };
      dirtyRef.current = true;
      setTurns([...history, reply]);
      if (model === null) {
        update(reply.id, (t) => ({ ...t, streaming: false, error: "No model: the server's /v1/models did not answer (see System)." }));
        return;
      }
      const messages: ChatMessage[] = history
        .filter((t) => t.error === null && (t.role === "user" || t.content !== ""))
        .map((t) => ({ role: t.role, content: t.content }));
      const parsedMax = Number.parseInt(maxTokens, 10);
      const parsedTemp = Number.parseFloat(temperature);
      const req = buildChatRequest(conn, {
        model,
        messages,
        thinking,
        maxTokens: Number.isFinite(parsedMax) && parsedMax > 0 ? parsedMax : null,
        temperature: Number.isFinite(parsedTemp) ? parsedTemp : 0,
        slot,
        slotCount: facts.slotCount,
      });
      const controller = new AbortController();
      abortRef.current = controller;
      const startedAt = performance.now();
      const stats: Stats = { startedAt, firstAt: null, lastAt: null, pieces: 0, usage: null, queueWaitMs: null, finish: null, stopped: false };
      update(reply.id, (t) => ({ ...t, stats: { ...stats } }));
      try {
        await streamChat(
          req,
          controller.signal,
          (start) => {
            stats.queueWaitMs = start.queueWaitMs;
            update(reply.id, (t) => ({ ...t, stats: { ...stats } }));
          },
          (part) => {
            const at = performance.now();
            if (part.kind === "content" || part.kind === "reasoning") {
              if (stats.firstAt === null) stats.firstAt = at;
              stats.lastAt = at;
              stats.pieces += 1;
              const text = part.text;
              update(reply.id, (t) =>
                part.kind === "content"
                  ? { ...t, content: t.content + text, reasoningOpen: false, stats: { ...stats } }
                  : { ...t, reasoning: t.reasoning + text, stats: { ...stats } },
              );
            } else if (part.kind === "finish") {
              stats.finish = part.reason;
            } else if (part.kind === "usage") {
              stats.usage = part.usage;
            } else {
              throw part.error;
            }
          },
        );
        update(reply.id, (t) => ({ ...t, streaming: false, reasoningOpen: false, stats: { ...stats } }));
      } catch (e) {
        if (controller.signal.aborted) {
          stats.stopped = true;
          update(reply.id, (t) => ({ ...t, streaming: false, reasoningOpen: false, stats: { ...stats } }));
        } else {
          const message = e instanceof ServerError
            ? `${e.status !== null ? `${e.status}: ` : ""}${e.message}`
            : `error: ${e instanceof Error ? e.message : String(e)}`;
          update(reply.id, (t) => ({ ...t, streaming: false, reasoningOpen: false, error: message, stats: { ...stats } }));
        }
      } finally {
        if (abortRef.current === controller) abortRef.current = null;
      }
    },
    [conn, facts, maxTokens, temperature, thinking, slot, update],
  );

  const submit = (e?: FormEvent) => {
    e?.preventDefault();
    const text = draft.trim();
    if (!text || busy) return;
    setDraft("");
    stickRef.current = true;
    const user: Turn = { id: nextId++, role: "user", content: text, reasoning: "", reasoningOpen: false, streaming: false, error: null, stats: null };
    // Editing an earlier question: the conversation goes on from there, the later turns dropped.
    const at = editingId === null ? -1 : turns.findIndex((t) => t.id === editingId);
    setEditingId(null);
    void send([...(at >= 0 ? turns.slice(0, at) : turns), user]);
  };

  const regenerate = () => {
    if (busy) return;
    let last = turns.length - 1;
    while (last >= 0 && turns[last]?.role !== "user") last -= 1;
    if (last < 0) return;
    void send(turns.slice(0, last + 1));
  };

  const edit = (t: Turn) => {
    setEditingId(t.id);
    setDraft(t.content);
    promptRef.current?.focus();
  };

  const newChat = () => {
    setTurns([]);
    setEditingId(null);
    setConvId(newConversationId());
  };

  const openConversation = (c: Conversation) => {
    if (busy) return;
    setTurns(c.turns.map(fromTranscript));
    setConvId(c.id);
    setEditingId(null);
  };

  const exportAs = (kind: "json" | "md") => {
    const kept = turns.map(toTranscript);
    const stem = fileStem(titleOf(kept));
    if (kind === "json") download(`${stem}.json`, "application/json", toJson(facts.model, kept));
    else download(`${stem}.md`, "text/markdown", toMarkdown(facts.model, kept));
  };

  const shown = searchConversations(saved, query);

  const onKey = (e: KeyboardEvent<HTMLTextAreaElement>) => {
    if (e.key === "Enter" && !e.shiftKey && !e.nativeEvent.isComposing) {
      e.preventDefault();
      submit();
    } else if (e.key === "Escape" && busy) {
      stop();
    } else if (e.key === "Escape" && editingId !== null) {
      setEditingId(null);
      setDraft("");
    }
  };

  const lastUsage = [...turns].reverse().find((t) => t.stats?.usage)?.stats?.usage ?? null;

  return (
    <section className="chat" aria-label="Chat">
      <details className="history" data-testid="history">
        <summary>
          History ({saved.length})
        </summary>
        <div className="history-body">
          <div className="history-bar">
            <label className="sr-only" htmlFor="history-search">
              Search conversations
            </label>
            <input id="history-search" type="search" placeholder="Search conversations" value={query} onChange={(e) => setQuery(e.target.value)} />
            <button type="button" onClick={newChat} disabled={busy}>
              New chat
            </button>
          </div>
          {historyError !== null && <p className="error">{historyError}</p>}
          <ul className="history-list">
            {shown.map((c) => (
              <li key={c.id} className={c.id === convId ? "current" : undefined}>
                <button type="button" className="link" onClick={() => openConversation(c)} disabled={busy}>
                  {c.title}
                </button>
                <span className="muted small">{new Date(c.updatedAt).toLocaleString()}</span>
                <button
                  type="button"
                  className="small"
                  aria-label={`Delete conversation: ${c.title}`}
                  onClick={() => void deleteConversation(c.id).then(refreshSaved)}
                >
                  Delete
                </button>
              </li>
            ))}
            {shown.length === 0 && <li className="muted">{saved.length === 0 ? "No saved conversation yet." : "Nothing matches."}</li>}
          </ul>
          <p className="muted small">Kept in this browser (IndexedDB), never sent anywhere.</p>
        </div>
      </details>
      <div
        className="log"
        ref={logRef}
        role="log"
        aria-live="polite"
        onScroll={(e) => {
          const el = e.currentTarget;
          stickRef.current = el.scrollHeight - el.scrollTop - el.clientHeight < 40;
        }}
      >
        {turns.length === 0 && (
          <p className="empty">
            Ask the model something, e.g. <em>What is 37 + 48?</em> Enter sends, Shift+Enter adds a line, Escape stops a reply.
          </p>
        )}
        {turns.map((t) => (
          <article key={t.id} className={`turn ${t.role}`} data-testid={`turn-${t.role}`} aria-busy={t.streaming}>
            <div className="who">{t.role === "user" ? "You" : (facts.model ?? "model")}</div>
            {t.reasoning && (
              <details
                className="reasoning"
                open={t.reasoningOpen}
                onToggle={(e) => {
                  const open = e.currentTarget.open;
                  if (open !== t.reasoningOpen) update(t.id, (x) => ({ ...x, reasoningOpen: open }));
                }}
              >
                <summary>Reasoning</summary>
                <div className="reasoning-text" data-testid="reasoning">{t.reasoning}</div>
              </details>
            )}
            {t.role === "user" ? (
              <>
                <div className="plain">{t.content}</div>
                {!busy && (
                  <button type="button" className="copy" onClick={() => edit(t)} aria-label="Edit and resend this message">
                    Edit
                  </button>
                )}
              </>
            ) : (
              <div data-testid="answer">
                <Markdown text={t.content} />
              </div>
            )}
            {t.streaming && t.content === "" && t.reasoning === "" && <div className="waiting">waiting for the first token…</div>}
            {t.error !== null && (
              <div className="error" role="alert" data-testid="error">
                {t.error}
              </div>
            )}
            {t.stats && <StatsLine stats={t.stats} streaming={t.streaming} now={now} />}
            {t.role === "assistant" && !t.streaming && t.content && <CopyButton text={t.content} label="Copy reply" />}
          </article>
        ))}
      </div>
      <form className="composer" onSubmit={submit}>
        {editingId !== null && (
          <div className="editing" role="status">
            Editing an earlier message: sending it drops the turns after it.{" "}
            <button
              type="button"
              className="small"
              onClick={() => {
                setEditingId(null);
                setDraft("");
              }}
            >
              Cancel
            </button>
          </div>
        )}
        <label className="sr-only" htmlFor="prompt">
          Message
        </label>
        <textarea
          id="prompt"
          ref={promptRef}
          value={draft}
          rows={2}
          placeholder="Message the model"
          onChange={(e) => setDraft(e.target.value)}
          onKeyDown={onKey}
        />
        <div className="controls">
          <label>
            <input type="checkbox" checked={thinking} onChange={(e) => setThinking(e.target.checked)} /> Reasoning
          </label>
          <label>
            Max tokens{" "}
            <input className="num" inputMode="numeric" value={maxTokens} placeholder="auto" onChange={(e) => setMaxTokens(e.target.value)} />
          </label>
          <label>
            Temperature{" "}
            <input className="num" inputMode="decimal" value={temperature} onChange={(e) => setTemperature(e.target.value)} />
          </label>
          {facts.slotCount > 1 && (
            <label>
              KV slot{" "}
              <select value={slot ?? ""} onChange={(e) => setSlot(e.target.value === "" ? null : Number(e.target.value))}>
                <option value="">any</option>
                {Array.from({ length: facts.slotCount }, (_, i) => (
                  <option key={i} value={i}>
                    {i}
                  </option>
                ))}
              </select>
            </label>
          )}
          {facts.contextLength !== null && lastUsage && (
            <span className="meter" title="tokens of the context window used by the last turn">
              context {lastUsage.prompt_tokens + lastUsage.completion_tokens} / {facts.contextLength}
            </span>
          )}
          <span className="spacer" />
          <button type="button" onClick={regenerate} disabled={busy || !turns.some((t) => t.role === "user")}>
            Regenerate
          </button>
          <button type="button" onClick={() => exportAs("json")} disabled={busy || turns.length === 0}>
            Export JSON
          </button>
          <button type="button" onClick={() => exportAs("md")} disabled={busy || turns.length === 0}>
            Export Markdown
          </button>
          <button type="button" onClick={newChat} disabled={busy || turns.length === 0}>
            New chat
          </button>
          {busy ? (
            <button type="button" className="primary danger" onClick={stop}>
              Stop
            </button>
          ) : (
            <button type="submit" className="primary" disabled={!draft.trim()}>
              Send
            </button>
          )}
        </div>
      </form>
    </section>
  );
}
