import { describe, expect, it } from "vitest";
import { toJson, toMarkdown, type TranscriptTurn } from "./transcript";

const turns: TranscriptTurn[] = [
  { role: "user", content: "What is 37 + 48?", reasoning: "", finish: null },
  { role: "assistant", content: "85", reasoning: "7 + 8 = 15, carry 1.", finish: "stop" },
  { role: "user", content: "Show ``` fences", reasoning: "", finish: null },
  { role: "assistant", content: "cut", reasoning: "a ```` run", finish: "length" },
];

describe("transcript export", () => {
  it("writes JSON in the chat request's message shape, reasoning as reasoning_content", () => {
    const parsed = JSON.parse(toJson("colibri-demo", turns)) as { model: string; messages: Record<string, string>[] };
    expect(parsed.model).toBe("colibri-demo");
    expect(parsed.messages).toEqual([
      { role: "user", content: "What is 37 + 48?" },
      { role: "assistant", content: "85", reasoning_content: "7 + 8 = 15, carry 1." },
      { role: "user", content: "Show ``` fences" },
      { role: "assistant", content: "cut", reasoning_content: "a ```` run" },
    ]);
  });

  it("writes Markdown with the reasoning fenced so that it cannot break out", () => {
    const md = toMarkdown("colibri-demo", turns);
    expect(md.startsWith("# Conversation with colibri-demo\n")).toBe(true);
    expect(md).toContain("## You\n\nWhat is 37 + 48?\n");
    expect(md).toContain("```text\n7 + 8 = 15, carry 1.\n```\n");
    expect(md).toContain("`````text\na ```` run\n`````\n");
    expect(md).toContain("*(truncated: the reply hit its token budget)*");
    expect(md.match(/## colibri-demo/g)?.length).toBe(2);
  });
});
