// The playground's settings: the form fields, kept in this browser's localStorage so that a reload
// (or the next visit) finds the key and the parameters as they were left.

const STORAGE_KEY = "sluice-playground-settings";

// Each setting: its form field's id, and the request field it becomes (null: not a request field).
const FIELDS = [
  { id: "api-key", name: "apiKey", param: null },
  { id: "system-prompt", name: "systemPrompt", param: null },
  { id: "temperature", name: "temperature", param: "temperature" },
  { id: "top-p", name: "topP", param: "top_p" },
  { id: "max-tokens", name: "maxTokens", param: "max_tokens" },
];

function stored() {
  try {
    return JSON.parse(localStorage.getItem(STORAGE_KEY) ?? "{}") ?? {};
  } catch {
    return {};
  }
}

/** Fills the form from storage, and stores every later edit; `onKeyChange` runs when the key changes. */
export function bindSettings(onKeyChange) {
  const saved = stored();
  for (const field of FIELDS) {
    const input = document.getElementById(field.id);
    if (typeof saved[field.name] === "string") input.value = saved[field.name];
    input.addEventListener("input", () => {
      const now = stored();
      now[field.name] = input.value;
      localStorage.setItem(STORAGE_KEY, JSON.stringify(now));
      if (field.name === "apiKey") onKeyChange();
    });
  }
}

export function apiKey() {
  return document.getElementById("api-key").value;
}

export function systemPrompt() {
  return document.getElementById("system-prompt").value.trim();
}

/** The sampling fields the user filled in; an empty field is left out, so the server's default holds. */
export function samplingParameters() {
  const params = {};
  for (const field of FIELDS) {
    if (field.param === null) continue;
    const text = document.getElementById(field.id).value.trim();
    // The server answers a value out of range with a 400 that names the field; the page shows it.
    if (text !== "") params[field.param] = Number(text);
  }
  return params;
}
