import { describe, expect, it } from "vitest";
import { searchConversations, titleOf, type Conversation } from "./history";

const conv = (id: string, question: string, answer: string, reasoning = ""): Conversation => ({
  id,
  title: titleOf([{ role: "user", content: question, reasoning: "", finish: null }]),
  model: "colibri-demo",
  updatedAt: 0,
  turns: [
    { role: "user", content: question, reasoning: "", finish: null },
    { role: "assistant", content: answer, reasoning, finish: "stop" },
  ],
});

describe("history", () => {
  it("titles a conversation by its first question's first line, shortened", () => {
    expect(titleOf([{ role: "user", content: "  What is 37 + 48?\nmore", reasoning: "", finish: null }])).toBe("What is 37 + 48?");
    expect(titleOf([{ role: "user", content: "x".repeat(80), reasoning: "", finish: null }])).toBe(`${"x".repeat(59)}…`);
    expect(titleOf([])).toBe("(empty)");
  });
  it("finds conversations holding every word, in questions, answers or reasoning", () => {
    const all = [conv("a", "What is 37 + 48?", "85", "7 + 8 = 15, carry 1."), conv("b", "Capital of Portugal?", "Lisbon")];
    expect(searchConversations(all, "").map((c) => c.id)).toEqual(["a", "b"]);
    expect(searchConversations(all, "85").map((c) => c.id)).toEqual(["a"]);
    expect(searchConversations(all, "CARRY 37").map((c) => c.id)).toEqual(["a"]);
    expect(searchConversations(all, "lisbon").map((c) => c.id)).toEqual(["b"]);
    expect(searchConversations(all, "lisbon 85")).toEqual([]);
  });
});
