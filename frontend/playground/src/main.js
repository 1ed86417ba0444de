// The playground page: a chat with the served model through the OpenAI API.

import "highlight.js/styles/github.css";
import "./style.css";
import { ApiError, servedModel, streamChat } from "./chat_api.js";
import { renderMarkdown } from "./markdown.js";
import { ReplyStats } from "./reply_stats.js";
import { apiKey, bindSettings, samplingParameters, systemPrompt } from "./settings.js";

const elements = {
  messages: document.getElementById("messages"),
  composer: document.getElementById("composer"),
  prompt: document.getElementById("prompt"),
  send: document.getElementById("send"),
  stop: document.getElementById("stop"),
  newChat: document.getElementById("new-chat"),
  modelName: document.getElementById("model-name"),
};

// The conversation as the API sees it (without the system prompt, which is read at each send).
let history = [];
let model = null;
// Why the last attempt to learn the model's name failed (an ApiError), or null.
let modelError = null;
// The reply being streamed: its AbortController, or null when none is.
let inFlight = null;

// Each key edit asks again; only the latest question's answer counts.
let modelQuestion = 0;

async function loadModel() {
  const question = ++modelQuestion;
  model = null;
  elements.modelName.textContent = "…";
  try {
    const name = await servedModel(apiKey());
    if (question === modelQuestion) {
      model = name;
      modelError = null;
      elements.modelName.textContent = name;
    }
  } catch (error) {
    if (question === modelQuestion) {
      modelError = error instanceof ApiError ? error : new ApiError(String(error), 0);
      elements.modelName.textContent = error.status === 401 ? "enter the API key" : error.message;
    }
  }
  return model;
}

function nearBottom() {
  const box = elements.messages;
  return box.scrollHeight - box.scrollTop - box.clientHeight < 40;
}

function addMessage(role, state) {
  const article = document.createElement("article");
  article.className = `message ${role}`;
  article.dataset.state = state;
  const label = document.createElement("div");
  label.className = "role";
  label.textContent = role;
  const content = document.createElement("div");
  content.className = "content";
  const stats = document.createElement("div");
  stats.className = "stats";
  article.append(label, content, stats);
  elements.messages.append(article);
  elements.messages.scrollTop = elements.messages.scrollHeight;
  return article;
}

function showReply(article, text) {
  const follow = nearBottom();
  article.dataset.markdown = text;
  article.querySelector(".content").innerHTML = renderMarkdown(text);
  if (follow) elements.messages.scrollTop = elements.messages.scrollHeight;
}

function setBusy(busy) {
  elements.send.disabled = busy;
  elements.stop.disabled = !busy;
  elements.newChat.disabled = busy;
}

async function send() {
  const text = elements.prompt.value.trim();
  if (!text || inFlight) return;
  const controller = new AbortController();
  inFlight = controller;
  setBusy(true);
  elements.prompt.value = "";
  addMessage("user", "done").querySelector(".content").textContent = text;
  history.push({ role: "user", content: text });
  const reply = addMessage("assistant", "streaming");
  const stats = new ReplyStats();
  let content = "";
  // Rendering the markdown once per frame, not once per token, keeps long replies smooth.
  let frame = null;
  const render = () => {
    frame = null;
    showReply(reply, content);
  };
  try {
    const name = model ?? (await loadModel());
    if (!name) throw modelError ?? new ApiError("the model's name is not known yet", 0);
    const system = systemPrompt();
    await streamChat({
      apiKey: apiKey(),
      model: name,
      messages: system ? [{ role: "system", content: system }, ...history] : history,
      params: samplingParameters(),
      signal: controller.signal,
      onEvent(event) {
        if (event.content) {
          stats.piece();
          content += event.content;
          frame ??= requestAnimationFrame(render);
        }
        if (event.finishReason) stats.finishReason = event.finishReason;
        if (event.usage) stats.usage = event.usage;
      },
    });
    finishReply(reply, stats, content, "done");
  } catch (error) {
    if (controller.signal.aborted) {
      finishReply(reply, stats, content, "stopped");
    } else {
      // The failed turn leaves the history, and its text returns to the box, ready to send again.
      history.pop();
      if (!elements.prompt.value) elements.prompt.value = text;
      reply.dataset.state = "error";
      reply.querySelector(".content").textContent = error instanceof ApiError ? error.message : String(error);
      if (error.status === 401) document.getElementById("api-key").focus();
    }
  } finally {
    if (frame !== null) cancelAnimationFrame(frame);
    inFlight = null;
    setBusy(false);
    if (reply.dataset.state !== "error") elements.prompt.focus();
  }
}

function finishReply(reply, stats, content, state) {
  stats.finish();
  showReply(reply, content);
  // A stopped reply stays in the conversation as far as it got, as it is shown.
  history.push({ role: "assistant", content });
  const line = reply.querySelector(".stats");
  line.textContent = stats.summary(state === "stopped");
  if (stats.usage) {
    line.dataset.promptTokens = stats.usage.prompt_tokens;
    line.dataset.completionTokens = stats.usage.completion_tokens;
  }
  reply.dataset.state = state;
}

function stop() {
  inFlight?.abort();
}

elements.composer.addEventListener("submit", (event) => {
  event.preventDefault();
  send();
});
elements.prompt.addEventListener("keydown", (event) => {
  // isComposing: Enter that confirms an input method's candidate is not a send.
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    send();
  }
});
document.addEventListener("keydown", (event) => {
  if (event.key === "Escape" && inFlight) {
    event.preventDefault();
    stop();
  }
});
elements.stop.addEventListener("click", stop);
elements.newChat.addEventListener("click", () => {
  history = [];
  elements.messages.replaceChildren();
  elements.prompt.focus();
});

bindSettings(loadModel);
loadModel();
elements.prompt.focus();
