// Markdown to HTML for the replies. Raw HTML in a reply is escaped (html: false), and
// markdown-it refuses javascript:, vbscript: and most data: links, so a reply cannot run script.

import MarkdownIt from "markdown-it";
import hljs from "highlight.js/lib/core";
import bash from "highlight.js/lib/languages/bash";
import c from "highlight.js/lib/languages/c";
import cpp from "highlight.js/lib/languages/cpp";
import css from "highlight.js/lib/languages/css";
import go from "highlight.js/lib/languages/go";
import java from "highlight.js/lib/languages/java";
import javascript from "highlight.js/lib/languages/javascript";
import json from "highlight.js/lib/languages/json";
import python from "highlight.js/lib/languages/python";
import rust from "highlight.js/lib/languages/rust";
import sql from "highlight.js/lib/languages/sql";
import typescript from "highlight.js/lib/languages/typescript";
import xml from "highlight.js/lib/languages/xml";
import yaml from "highlight.js/lib/languages/yaml";

const LANGUAGES = { bash, c, cpp, css, go, java, javascript, json, python, rust, sql, typescript, xml, yaml };
for (const [name, language] of Object.entries(LANGUAGES)) hljs.registerLanguage(name, language);

const markdown = new MarkdownIt({
  html: false,
  linkify: true,
  // A fence with a known language is highlighted; markdown-it escapes the others itself.
  highlight(code, language) {
    if (!language || !hljs.getLanguage(language)) return "";
    return hljs.highlight(code, { language, ignoreIllegals: true }).value;
  },
});

const defaultLinkOpen =
  markdown.renderer.rules.link_open ?? ((tokens, index, options, env, self) => self.renderToken(tokens, index, options));
markdown.renderer.rules.link_open = (tokens, index, options, env, self) => {
  tokens[index].attrSet("target", "_blank");
  tokens[index].attrSet("rel", "noopener noreferrer");
  return defaultLinkOpen(tokens, index, options, env, self);
};

// A table column's alignment becomes a class: the page's Content-Security-Policy refuses inline styles.
markdown.core.ruler.push("alignment_classes", (state) => {
  for (const token of state.tokens) {
    const style = token.attrGet("style");
    const align = style?.match(/^text-align:(left|center|right)$/)?.[1];
    if (align) {
      token.attrs = token.attrs.filter(([name]) => name !== "style");
      token.attrJoin("class", `align-${align}`);
    }
  }
});

export function renderMarkdown(text) {
  return markdown.render(text);
}
