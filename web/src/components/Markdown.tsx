// Markdown of model replies: GFM through react-markdown, which renders no raw HTML and drops
// unsafe link schemes; code blocks highlighted by lowlight into React elements (no innerHTML).

import type { Element, ElementContent, Root } from "hast";
import { toJsxRuntime } from "hast-util-to-jsx-runtime";
import { createLowlight } from "lowlight";
import bash from "highlight.js/lib/languages/bash";
import c from "highlight.js/lib/languages/c";
import cpp from "highlight.js/lib/languages/cpp";
import go from "highlight.js/lib/languages/go";
import javascript from "highlight.js/lib/languages/javascript";
import json from "highlight.js/lib/languages/json";
import python from "highlight.js/lib/languages/python";
import rust from "highlight.js/lib/languages/rust";
import typescript from "highlight.js/lib/languages/typescript";
import xml from "highlight.js/lib/languages/xml";
import yaml from "highlight.js/lib/languages/yaml";
import { memo, useState, type ReactNode } from "react";
import { Fragment, jsx, jsxs } from "react/jsx-runtime";
import ReactMarkdown, { type Components } from "react-markdown";
import remarkGfm from "remark-gfm";

const lowlight = createLowlight({ bash, c, cpp, go, javascript, json, python, rust, typescript, xml, yaml });
const ALIASES: Record<string, string> = {
  sh: "bash", shell: "bash", js: "javascript", ts: "typescript", py: "python", rs: "rust",
  html: "xml", yml: "yaml", "c++": "cpp",
};

function textOf(node: ElementContent | Element): string {
  if (node.type === "text") return node.value;
  if (node.type === "element") return node.children.map(textOf).join("");
  return "";
}

function languageOf(code: Element): string | null {
  const cls = code.properties.className;
  const list = Array.isArray(cls) ? cls.map(String) : typeof cls === "string" ? [cls] : [];
  const found = list.find((c) => c.startsWith("language-"));
  return found ? found.slice("language-".length).toLowerCase() : null;
}

export function highlight(code: string, lang: string | null): ReactNode {
  const name = lang ? (ALIASES[lang] ?? lang) : null;
  if (name === null || !lowlight.registered(name)) return code;
  const tree: Root = lowlight.highlight(name, code);
  return toJsxRuntime(tree, { Fragment, jsx, jsxs });
}

async function copyText(text: string): Promise<boolean> {
  try {
    await navigator.clipboard.writeText(text);
    return true;
  } catch {
    // Not a secure context, or permission refused: the old way.
    const area = document.createElement("textarea");
    area.value = text;
    area.setAttribute("readonly", "");
    area.style.position = "fixed";
    area.style.opacity = "0";
    document.body.appendChild(area);
    area.select();
    const ok = document.execCommand("copy");
    area.remove();
    return ok;
  }
}

export function CopyButton({ text, label }: { text: string; label: string }) {
  const [state, setState] = useState<"idle" | "done" | "failed">("idle");
  return (
    <button
      type="button"
      className="copy"
      aria-label={label}
      onClick={() => {
        void copyText(text).then((ok) => {
          setState(ok ? "done" : "failed");
          window.setTimeout(() => setState("idle"), 1500);
        });
      }}
    >
      {state === "done" ? "Copied" : state === "failed" ? "Copy failed" : "Copy"}
    </button>
  );
}

function CodeBlock({ node }: { node: Element | undefined }) {
  const code = node?.children.find((c): c is Element => c.type === "element" && c.tagName === "code");
  if (!code) return <pre>{node ? textOf(node) : ""}</pre>;
  const text = textOf(code).replace(/\n$/, "");
  const lang = languageOf(code);
  return (
    <div className="codeblock">
      <div className="codebar">
        <span>{lang ?? "text"}</span>
        <CopyButton text={text} label="Copy code" />
      </div>
      <pre tabIndex={0}>
        <code className={`hljs${lang ? ` language-${lang}` : ""}`}>{highlight(text, lang)}</code>
      </pre>
    </div>
  );
}

const components: Components = {
  pre: ({ node }) => <CodeBlock node={node} />,
  a: ({ href, children }) => (
    <a href={href} target="_blank" rel="noopener noreferrer">
      {children}
    </a>
  ),
  img: ({ alt }) => <span className="img-alt">[image: {alt ?? ""}]</span>,
};

export const Markdown = memo(function Markdown({ text }: { text: string }) {
  return (
    <div className="md">
      <ReactMarkdown remarkPlugins={[remarkGfm]} components={components} skipHtml>
        {text}
      </ReactMarkdown>
    </div>
  );
});
