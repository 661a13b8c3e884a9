import { describe, expect, it } from "vitest";
import { ServerError, errorFromResponse } from "./api";
import {
  buildBrioBody,
  buildBrioRequest,
  entropyLabel,
  formProblem,
  isRouteAbsent,
  parseAnswers,
  readBrioReply,
  scoreBrio,
  type BrioForm,
} from "./brio";
import { parseRoute } from "./route";

const one: BrioForm = {
  model: "colibri-demo",
  state: "Maths homework.",
  questions: [{ question: " What is 37 + 48? ", answers: "85\n 45 \n\n42\n" }],
  normalize: "sum",
};

const two: BrioForm = {
  ...one,
  questions: [
    { question: "What is 37 + 48?", answers: "85\n45" },
    { question: "What is the capital of Portugal?", answers: "The capital of Portugal is Lisbon.\nThe capital of Spain is Madrid." },
  ],
};

const choice = { option: "85", p: 0.9, logprob: -0.1, mean_logprob: -0.05, tokens: 2 };
const other = { option: "45", p: 0.1, logprob: -2.3, mean_logprob: -1.15, tokens: 2 };

describe("parseAnswers", () => {
  it("takes one answer a line, trimmed, without blank lines, commas kept", () => {
    expect(parseAnswers(" 85 \r\n\n45\nyes, surely\n  ")).toEqual(["85", "45", "yes, surely"]);
    expect(parseAnswers("")).toEqual([]);
  });
});

describe("buildBrioBody", () => {
  it("sends one question as the options form", () => {
    expect(buildBrioBody(one)).toEqual({
      model: "colibri-demo",
      state: "Maths homework.",
      question: "What is 37 + 48?",
      options: ["85", "45", "42"],
    });
  });

  it("leaves out an empty document and question, and sends normalize only when not the default", () => {
    const body = buildBrioBody({ ...one, state: "  ", questions: [{ question: "", answers: "a\nb" }], normalize: "mean" });
    expect(body).toEqual({ model: "colibri-demo", options: ["a", "b"], normalize: "mean" });
  });

  it("sends several questions as the questions form", () => {
    expect(buildBrioBody(two)).toEqual({
      model: "colibri-demo",
      state: "Maths homework.",
      questions: [
        { question: "What is 37 + 48?", options: ["85", "45"] },
        { question: "What is the capital of Portugal?", options: ["The capital of Portugal is Lisbon.", "The capital of Spain is Madrid."] },
      ],
    });
  });

  it("posts JSON to /v1/brio with the Bearer key when there is one", () => {
    const r = buildBrioRequest({ baseUrl: "http://h:1/", apiKey: "k" }, one);
    expect(r.url).toBe("http://h:1/v1/brio");
    expect(r.init.method).toBe("POST");
    expect(r.init.headers).toEqual({ "Content-Type": "application/json", Authorization: "Bearer k" });
    expect(buildBrioRequest({ baseUrl: "", apiKey: "" }, one).init.headers).toEqual({ "Content-Type": "application/json" });
  });
});

describe("formProblem", () => {
  it("accepts a complete form", () => {
    expect(formProblem(one)).toBeNull();
    expect(formProblem(two)).toBeNull();
    expect(formProblem({ ...one, state: "" })).toBeNull();
  });

  it("names what the server would surely refuse", () => {
    expect(formProblem({ ...one, questions: [] })).toBe("Add a question.");
    expect(formProblem({ ...one, questions: [{ question: "Q?", answers: "only" }] })).toMatch(/at least 2 answers/);
    expect(formProblem({ ...one, questions: [{ question: "Q?", answers: "a\na" }] })).toBe('The question lists "a" twice.');
    expect(formProblem({ ...one, state: "", questions: [{ question: " ", answers: "a\nb" }] })).toBe("Give a document or a question.");
    expect(formProblem({ ...two, state: "" })).toBe("Several questions need a document to read.");
    expect(formProblem({ ...two, questions: [two.questions[0]!, { question: "", answers: "a\nb" }] })).toBe("Question 2 has no text.");
  });
});

describe("entropyLabel", () => {
  it("reads the entropy as the docs do: below 0.4, 0.4 to 0.8, above 0.8", () => {
    expect(entropyLabel(0)).toBe("confident");
    expect(entropyLabel(0.399)).toBe("confident");
    expect(entropyLabel(0.4)).toBe("unsure");
    expect(entropyLabel(0.8)).toBe("unsure");
    expect(entropyLabel(0.801)).toBe("coin flip");
    expect(entropyLabel(1)).toBe("coin flip");
  });
});

describe("readBrioReply", () => {
  it("reads brio.choice as one answer to the question asked", () => {
    const body = { object: "brio.choice", answer: "85", entropy: 0.2, normalize: "sum", choices: [choice, other] };
    expect(readBrioReply(body, "What is 37 + 48?")).toEqual([
      { question: "What is 37 + 48?", answer: "85", entropy: 0.2, normalize: "sum", choices: [choice, other] },
    ]);
  });

  it("reads brio.answers in request order, choices as sent", () => {
    const body = {
      object: "brio.answers",
      answers: [
        { question: "A?", answer: "85", entropy: 0, normalize: "sum", choices: [choice, other] },
        { question: "B?", answer: "45", entropy: 0.9, normalize: "mean", choices: [other, choice] },
      ],
    };
    const got = readBrioReply(body);
    expect(got.map((a) => [a.question, a.answer, a.normalize])).toEqual([
      ["A?", "85", "sum"],
      ["B?", "45", "mean"],
    ]);
    expect(got[1]?.choices.map((c) => c.option)).toEqual(["45", "85"]);
  });

  it("refuses anything else", () => {
    expect(() => readBrioReply({ object: "brio.schema" })).toThrow(ServerError);
    expect(() => readBrioReply([])).toThrow(/not a JSON object/);
  });
});

describe("isRouteAbsent", () => {
  it("tells a missing route from an unknown model", () => {
    const route = errorFromResponse(404, JSON.stringify({ error: { message: "No route POST /v1/brio", code: "not_found" } }), null);
    const model = errorFromResponse(404, JSON.stringify({ error: { message: "no such model", code: "model_not_found" } }), null);
    expect(isRouteAbsent(route)).toBe(true);
    expect(isRouteAbsent(errorFromResponse(404, "Not Found", null))).toBe(true);
    expect(isRouteAbsent(model)).toBe(false);
    expect(isRouteAbsent(new Error("x"))).toBe(false);
  });
});

describe("scoreBrio", () => {
  it("returns the answers and the queue wait and elapsed headers", async () => {
    const fake: typeof fetch = async () =>
      new Response(JSON.stringify({ object: "brio.choice", answer: "85", entropy: 0, normalize: "sum", choices: [choice, other] }), {
        status: 200,
        headers: { "x-colibri-queue-wait-ms": "1.5", "x-colibri-elapsed-ms": "107.6" },
      });
    const r = await scoreBrio({ baseUrl: "", apiKey: "" }, one, new AbortController().signal, fake);
    expect(r.queueWaitMs).toBe(1.5);
    expect(r.elapsedMs).toBe(107.6);
    expect(r.answers[0]?.question).toBe("What is 37 + 48?");
  });

  it("rejects with the server's words", async () => {
    const fake: typeof fetch = async () =>
      new Response(JSON.stringify({ error: { message: "'options' lists 'a' twice", code: "invalid_value" } }), { status: 400 });
    await expect(scoreBrio({ baseUrl: "", apiKey: "" }, one, new AbortController().signal, fake)).rejects.toMatchObject({
      status: 400,
      message: "'options' lists 'a' twice",
    });
  });
});

describe("parseRoute", () => {
  it("knows the brio page", () => {
    expect(parseRoute("#/brio")).toBe("brio");
  });
});
