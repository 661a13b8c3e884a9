// The Brio page's contract with `POST /v1/brio` (docs/API.md, "Closed-set scoring"): the
// request built from the form, the reply read into one shape for both forms, and the entropy
// in words. Pure helpers are exported for the unit tests.

import { ServerError, authHeaders, endpoint, errorFromResponse, fetchOrUnreachable, type BuiltRequest, type Connection } from "./api";

export type Normalize = "sum" | "mean";

/** One question of the form: its text and its allowed answers, one per line. */
export interface QuestionDraft {
  question: string;
  answers: string;
}

export interface BrioForm {
  model: string;
  state: string;
  questions: QuestionDraft[];
  normalize: Normalize;
}

export interface BrioChoice {
  option: string;
  p: number;
  logprob: number;
  mean_logprob: number;
  tokens: number;
}

export interface BrioAnswer {
  question: string | null;
  answer: string;
  entropy: number;
  normalize: string;
  choices: BrioChoice[];
}

export interface BrioResult {
  answers: BrioAnswer[];
  queueWaitMs: number | null;
  elapsedMs: number | null;
}

/** The server's limits on options per question (python/colibri/api/brio_request.py). */
export const MIN_OPTIONS = 2;
export const MAX_OPTIONS = 64;
export const MAX_QUESTIONS = 64;

/** A question's allowed answers: one per line, trimmed, blank lines dropped. (Lines, not
 * commas: an answer the demo model would give is a sentence, which may hold a comma.) */
export function parseAnswers(text: string): string[] {
  return text
    .split(/\r?\n/)
    .map((line) => line.trim())
    .filter((line) => line !== "");
}

/** What stops the form from being sent, in words, else null. The server checks everything
 * again and says what it refuses in its own words; this only catches what it would surely
 * refuse before a request is made. */
export function formProblem(form: BrioForm): string | null {
  if (form.questions.length === 0) return "Add a question.";
  if (form.questions.length > MAX_QUESTIONS) return `At most ${MAX_QUESTIONS} questions.`;
  const several = form.questions.length > 1;
  if (several && !form.state.trim()) return "Several questions need a document to read.";
  if (!several && !form.state.trim() && !(form.questions[0]?.question.trim() ?? "")) {
    return "Give a document or a question.";
  }
  for (const [i, q] of form.questions.entries()) {
    const name = several ? `Question ${i + 1}` : "The question";
    if (several && !q.question.trim()) return `${name} has no text.`;
    const answers = parseAnswers(q.answers);
    if (answers.length < MIN_OPTIONS) return `${name} needs at least ${MIN_OPTIONS} answers, one per line.`;
    if (answers.length > MAX_OPTIONS) return `${name} has more than ${MAX_OPTIONS} answers.`;
    const seen = new Set<string>();
    for (const a of answers) {
      if (seen.has(a)) return `${name} lists "${a}" twice.`;
      seen.add(a);
    }
  }
  return null;
}

/** The request body: the `options` form for one question (its text optional), else the
 * `questions` form. An empty document is left out (the options form may go without). */
export function buildBrioBody(form: BrioForm): Record<string, unknown> {
  const body: Record<string, unknown> = { model: form.model };
  if (form.state.trim()) body.state = form.state;
  const [only] = form.questions;
  if (form.questions.length === 1 && only) {
    const question = only.question.trim();
    if (question) body.question = question;
    body.options = parseAnswers(only.answers);
  } else {
    body.questions = form.questions.map((q) => ({ question: q.question.trim(), options: parseAnswers(q.answers) }));
  }
  if (form.normalize !== "sum") body.normalize = form.normalize;
  return body;
}

export function buildBrioRequest(conn: Connection, form: BrioForm): BuiltRequest {
  return {
    url: endpoint(conn, "/v1/brio"),
    init: {
      method: "POST",
      headers: { "Content-Type": "application/json", ...authHeaders(conn) },
      body: JSON.stringify(buildBrioBody(form)),
    },
  };
}

export type EntropyLabel = "confident" | "unsure" | "coin flip";

/** The docs' reading of the normalised entropy: below 0.4 confident, 0.4-0.8 unsure, above
 * 0.8 a coin flip. */
export function entropyLabel(entropy: number): EntropyLabel {
  if (entropy < 0.4) return "confident";
  if (entropy <= 0.8) return "unsure";
  return "coin flip";
}

function isRecord(v: unknown): v is Record<string, unknown> {
  return typeof v === "object" && v !== null && !Array.isArray(v);
}

function readChoice(v: unknown): BrioChoice | null {
  if (!isRecord(v) || typeof v.option !== "string" || typeof v.p !== "number") return null;
  const num = (x: unknown) => (typeof x === "number" ? x : NaN);
  return { option: v.option, p: v.p, logprob: num(v.logprob), mean_logprob: num(v.mean_logprob), tokens: num(v.tokens) };
}

function readAnswer(v: unknown, question: string | null): BrioAnswer | null {
  if (!isRecord(v) || typeof v.answer !== "string" || typeof v.entropy !== "number") return null;
  const choices = Array.isArray(v.choices) ? v.choices.map(readChoice).filter((c): c is BrioChoice => c !== null) : [];
  return {
    question: typeof v.question === "string" ? v.question : question,
    answer: v.answer,
    entropy: v.entropy,
    normalize: typeof v.normalize === "string" ? v.normalize : "sum",
    choices,
  };
}

/** A reply of either form as a list of answers in request order (`brio.choice` is one answer,
 * its question the one asked). */
export function readBrioReply(body: unknown, askedQuestion: string | null = null): BrioAnswer[] {
  if (!isRecord(body)) throw new ServerError("the server's reply is not a JSON object", null, null);
  if (body.object === "brio.choice") {
    const one = readAnswer(body, askedQuestion);
    if (one) return [one];
  } else if (body.object === "brio.answers" && Array.isArray(body.answers)) {
    const all = body.answers.map((a) => readAnswer(a, null));
    if (all.every((a): a is BrioAnswer => a !== null)) return all;
  }
  throw new ServerError(`unexpected reply from /v1/brio (object ${JSON.stringify(body.object)})`, null, null);
}

/** A 404 that is the route missing (an older server), not the model unknown. */
export function isRouteAbsent(e: unknown): boolean {
  return e instanceof ServerError && e.status === 404 && e.code !== "model_not_found";
}

function header(res: Response, name: string): number | null {
  const v = res.headers.get(name);
  const n = v === null ? NaN : Number(v);
  return Number.isFinite(n) ? n : null;
}

/** Scores the form on the server; rejects with ServerError in the server's words. */
export async function scoreBrio(
  conn: Connection,
  form: BrioForm,
  signal: AbortSignal,
  fetchImpl: typeof fetch = fetch,
): Promise<BrioResult> {
  const req = buildBrioRequest(conn, form);
  const res = await fetchOrUnreachable(fetchImpl, req.url, { ...req.init, signal });
  const text = await res.text();
  if (!res.ok) throw errorFromResponse(res.status, text, res.headers.get("retry-after"));
  let body: unknown;
  try {
    body = JSON.parse(text);
  } catch {
    throw new ServerError(`unreadable reply from /v1/brio: ${text.slice(0, 200)}`, res.status, null);
  }
  const asked = form.questions.length === 1 ? (form.questions[0]?.question.trim() || null) : null;
  return {
    answers: readBrioReply(body, asked),
    queueWaitMs: header(res, "x-colibri-queue-wait-ms"),
    elapsedMs: header(res, "x-colibri-elapsed-ms"),
  };
}
