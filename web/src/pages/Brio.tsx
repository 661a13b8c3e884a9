import { useEffect, useRef, useState, type FormEvent, type KeyboardEvent } from "react";
import { errorText, type Connection } from "../lib/api";
import {
  MAX_QUESTIONS,
  entropyLabel,
  formProblem,
  isRouteAbsent,
  scoreBrio,
  type BrioAnswer,
  type BrioForm,
  type BrioResult,
  type Normalize,
  type QuestionDraft,
} from "../lib/brio";

interface Draft extends QuestionDraft {
  key: number;
}

const EXAMPLE: Draft = { key: 0, question: "What is 37 + 48?", answers: "85\n45\n42" };

function percent(p: number): string {
  const v = p * 100;
  return v >= 10 || v === 0 ? `${v.toFixed(0)}%` : v >= 0.1 ? `${v.toFixed(1)}%` : "<0.1%";
}

function ms(v: number): string {
  return v < 1000 ? `${v.toFixed(0)} ms` : `${(v / 1000).toFixed(2)} s`;
}

function AnswerCard({ a, n }: { a: BrioAnswer; n: number }) {
  const label = entropyLabel(a.entropy);
  return (
    <div className="card" data-testid="brio-answer">
      <h2>{a.question ?? `Answer ${n}`}</h2>
      <p className="brio-answer">
        <span className="muted">answer</span> <strong data-testid="brio-choice">{a.answer}</strong>{" "}
        <span className={`badge entropy ${label.replace(" ", "-")}`} data-testid="brio-entropy" title="normalised entropy: below 0.4 confident, 0.4–0.8 unsure, above 0.8 a coin flip">
          entropy {a.entropy.toFixed(2)}: {label}
        </span>
      </p>
      <ul className="brio-bars" aria-label="probability of each answer">
        {a.choices.map((c) => (
          <li key={c.option} className={c.option === a.answer ? "chosen" : undefined}>
            <span className="brio-option">{c.option}</span>
            <span className="brio-bar" role="img" aria-label={`${c.option}: ${percent(c.p)}`} data-testid="brio-bar">
              <span style={{ width: `${(Math.max(0, Math.min(1, c.p)) * 100).toFixed(2)}%` }} />
            </span>
            <span className="brio-p" title={`log-probability ${c.logprob.toFixed(3)} over ${c.tokens} tokens (mean ${c.mean_logprob.toFixed(3)})`}>
              {percent(c.p)}
            </span>
          </li>
        ))}
      </ul>
    </div>
  );
}

export function Brio({ conn, model }: { conn: Connection; model: string | null }) {
  const [state, setState] = useState("Maths homework for Monday.");
  const [drafts, setDrafts] = useState<Draft[]>([EXAMPLE]);
  const [normalize, setNormalize] = useState<Normalize>("sum");
  const [busy, setBusy] = useState(false);
  const [result, setResult] = useState<BrioResult | null>(null);
  const [error, setError] = useState<string | null>(null);
  const [absent, setAbsent] = useState(false);
  const nextKey = useRef(1);
  const inflight = useRef<AbortController | null>(null);

  useEffect(() => () => inflight.current?.abort(), []);

  const form: BrioForm | null = model === null ? null : { model, state, questions: drafts, normalize };
  const problem = form === null ? "No model: the server's /v1/models did not answer (see System)." : formProblem(form);

  const update = (key: number, change: Partial<QuestionDraft>) =>
    setDrafts((ds) => ds.map((d) => (d.key === key ? { ...d, ...change } : d)));

  const submit = async (e: FormEvent | KeyboardEvent) => {
    e.preventDefault();
    if (busy || form === null || problem !== null) return;
    const controller = new AbortController();
    inflight.current = controller;
    setBusy(true);
    setError(null);
    setAbsent(false);
    try {
      setResult(await scoreBrio(conn, form, controller.signal));
    } catch (err) {
      if (controller.signal.aborted) return;
      setResult(null);
      if (isRouteAbsent(err)) setAbsent(true);
      else setError(errorText(err));
    } finally {
      if (!controller.signal.aborted) setBusy(false);
    }
  };

  return (
    <section className="system brio" aria-label="Brio">
      <h1>Brio: closed-set scoring</h1>
      <p className="muted small">
        The model reads each allowed answer after the document and the question, and picks the one it finds most probable: nothing
        is generated (<code>POST /v1/brio</code>). The demo model answers in its own words, e.g. a sum with the number alone.
      </p>
      <form
        className="card brio-form"
        onSubmit={(e) => void submit(e)}
        onKeyDown={(e) => {
          // Ctrl+Enter (Cmd+Enter) scores from any field, a textarea's Enter being a new line.
          if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) void submit(e);
        }}
        aria-busy={busy}
      >
        <label className="brio-field">
          <span>Document</span>
          <textarea id="brio-state" rows={3} value={state} onChange={(e) => setState(e.target.value)} placeholder="The text the questions are about (optional with one question)" />
        </label>
        {drafts.map((d, i) => (
          <fieldset key={d.key} className="brio-question" data-testid="brio-question">
            <legend>Question {i + 1}</legend>
            <label className="brio-field">
              <span>Question</span>
              <input type="text" value={d.question} onChange={(e) => update(d.key, { question: e.target.value })} placeholder="e.g. What is 37 + 48?" />
            </label>
            <label className="brio-field">
              <span>Allowed answers, one per line</span>
              <textarea rows={3} value={d.answers} onChange={(e) => update(d.key, { answers: e.target.value })} placeholder={"85\n45\n42"} />
            </label>
            {drafts.length > 1 && (
              <button type="button" onClick={() => setDrafts((ds) => ds.filter((x) => x.key !== d.key))} aria-label={`Remove question ${i + 1}`}>
                Remove
              </button>
            )}
          </fieldset>
        ))}
        <div className="controls">
          <button
            type="button"
            disabled={drafts.length >= MAX_QUESTIONS}
            onClick={() => setDrafts((ds) => [...ds, { key: nextKey.current++, question: "", answers: "" }])}
          >
            Add question
          </button>
          <label>
            Score{" "}
            <select value={normalize} onChange={(e) => setNormalize(e.target.value === "mean" ? "mean" : "sum")}>
              <option value="sum">sum of token log-probabilities</option>
              <option value="mean">mean per token</option>
            </select>
          </label>
          <span className="spacer" />
          <button type="submit" className="primary" disabled={busy || problem !== null} title="Score (Ctrl+Enter)">
            {busy ? "Scoring…" : "Score"}
          </button>
        </div>
        {problem !== null && (
          <p className="muted small" data-testid="brio-problem">
            {problem}
          </p>
        )}
      </form>
      {absent && (
        <div className="error" role="alert" data-testid="brio-absent">
          This server has no /v1/brio route (it answered 404): closed-set scoring needs a newer colibri.
        </div>
      )}
      {error !== null && (
        <div className="error" role="alert" data-testid="brio-error">
          {error}
        </div>
      )}
      {result !== null && (
        <div className="brio-results" data-testid="brio-results">
          {(result.queueWaitMs !== null || result.elapsedMs !== null) && (
            <p className="muted small" data-testid="brio-timing">
              {result.queueWaitMs !== null && `queue wait ${ms(result.queueWaitMs)}`}
              {result.queueWaitMs !== null && result.elapsedMs !== null && ", "}
              {result.elapsedMs !== null && `elapsed ${ms(result.elapsedMs)}`}
            </p>
          )}
          {result.answers.map((a, i) => (
            <AnswerCard key={i} a={a} n={i + 1} />
          ))}
        </div>
      )}
    </section>
  );
}
