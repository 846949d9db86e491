// kernel_env's web view: running sessions, and one episode as a notebook, live.
// No build step and no CDN. Kernel output is data: text goes in with textContent, images as
// data: URLs, and HTML or SVG only inside <iframe sandbox="allow-same-origin">: no scripts run
// there, so nothing a cell produces runs in this page or can read its token; the same origin
// only lets this page measure the frame, to fit its height to the output.
// /web#session=ID opens one session (the link beside its title). Ended episodes, which the
// server's episode store kept (GET /episodes), are listed below, and open read-only from
// their stored notebook (/web#episode=ID).
"use strict";

const TOKEN_KEY = "kernel_env_token";
let selected = null;   // the session id shown
let stored = null;     // or the id of the ended episode shown
let watch = 0;         // bumped to stop an old session's event loop

const $ = (id) => document.getElementById(id);

function el(tag, attrs = {}, text) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

function headers() {
  const token = sessionStorage.getItem(TOKEN_KEY);
  return token ? { Authorization: "Bearer " + token } : {};
}

async function api(path) {
  const response = await fetch(path, { headers: headers(), cache: "no-store" });
  if (response.status === 401 || response.status === 403) {
    $("login").hidden = false;
    throw new Error("this server needs its token");
  }
  if (!response.ok) {
    const error = new Error(path + ": HTTP " + response.status);
    error.status = response.status;
    throw error;
  }
  return response;
}

// -- the session list ---------------------------------------------------------------------

// A page of sessions at a time (GET /sessions pages them): a server running a thousand
// lists a hundred here, and "next" shows those opened after them.
const PAGE = 100;
let pages = [0];       // the `after` of every page from the first to the one shown
let nextPage = null;   // the `after` of the page after the one shown (null: none)

async function refreshSessions() {
  try {
    const after = pages[pages.length - 1];
    const body = await (await api("/sessions?limit=" + PAGE + "&after=" + after)).json();
    if (!body.sessions.length && pages.length > 1) {  // every session of this page closed
      pages.pop();
      return refreshSessions();
    }
    nextPage = body.next;
    const shown = body.sessions.length;
    $("status").textContent = shown < body.total ? shown + " of " + body.total + " session(s)" : body.total + " session(s)";
    $("previous-page").hidden = pages.length === 1;
    $("next-page").hidden = nextPage === null;
    $("sessions").replaceChildren(...body.sessions.map(sessionRow));
  } catch (error) {
    $("status").textContent = error.message;
  }
}

function turnPage(forward) {
  if (forward && nextPage !== null) pages.push(nextPage);
  else if (!forward && pages.length > 1) pages.pop();
  refreshSessions();
}

function sessionRow(s) {
  const e = s.episode || {};
  const row = el("tr", { "data-session": s.session_id });
  const cells = [
    s.session_id.slice(0, 8), e.task || "", e.steps === undefined ? "" : e.steps + "/" + e.max_iterations,
    e.elapsed_s === undefined ? "" : Math.round(e.elapsed_s) + " s", s.state,
    e.llm_calls === undefined ? "" : String(e.llm_calls), e.llm_tokens === undefined ? "" : String(e.llm_tokens),
  ];
  for (const text of cells) row.append(el("td", {}, text));
  if (s.session_id === selected) row.classList.add("selected");
  row.addEventListener("click", () => show(s.session_id));
  return row;
}

// -- one episode ---------------------------------------------------------------------------

function show(sessionId) {
  selected = sessionId;
  stored = null;
  $("download-html").hidden = false;
  const mine = ++watch;
  $("episode").hidden = false;
  $("cells").replaceChildren();
  $("title").textContent = "";
  $("episode-id").textContent = sessionId;
  $("kernel-id").textContent = "kernel " + kernelId(sessionId);
  const link = "#session=" + encodeURIComponent(sessionId);
  $("session-link").href = link;
  if (location.hash !== link) history.replaceState(null, "", link);
  for (const row of $("sessions").children) row.classList.toggle("selected", row.dataset.session === sessionId);
  follow(sessionId, mine);
}

// The session's id as Jupyter's kernel API names its kernel: a UUID.
function kernelId(sessionId) {
  return sessionId.replace(/^([0-9a-f]{8})([0-9a-f]{4})([0-9a-f]{4})([0-9a-f]{4})([0-9a-f]{12})$/, "$1-$2-$3-$4-$5");
}

async function follow(sessionId, mine) {
  let after = 0;
  while (mine === watch) {
    try {
      const url = "/web/api/sessions/" + encodeURIComponent(sessionId) + "/events?after=" + after + "&wait=10";
      const body = await (await api(url)).json();
      for (const event of body.events) render(event);
      after = body.last;
      if (body.closed) return;
    } catch (error) {
      if (error.status === 404) {  // the session is gone: its episode is among the ended ones
        const note = "This session has ended: its episode, if the server kept it, is listed under Ended episodes.";
        $("cells").append(el("div", { class: "note" }, note));
        return;
      }
      $("status").textContent = error.message;
      await new Promise((resolve) => setTimeout(resolve, 2000));
    }
  }
}

let cell = null;  // the cell being written

function render(event) {
  if (event.kind === "episode") {
    $("cells").replaceChildren();
    $("title").textContent = event.task || "(no task)";
    document.title = "kernel_env: " + (event.task || event.episode_id);
    $("episode-id").textContent = event.episode_id;
  } else if (event.kind === "step") {
    const person = event.author && event.author !== "agent";
    cell = el("div", { class: person ? "cell running person" : "cell running" });
    if (person) cell.append(el("div", { class: "author" }, "run from " + event.author + " (a person attached to the kernel)"));
    cell.append(el("div", { class: "prompt" }, "In [ ]:"));
    cell.append(el("pre", { class: "code" }, event.is_final ? "(final answer submitted)" : event.code));
    cell.append(el("div", { class: "outputs" }));
    $("cells").append(cell);
  } else if (event.kind === "output" && cell) {
    addOutput(cell.querySelector(".outputs"), event.output);
  } else if (event.kind === "step_end" && cell) {
    endStep(cell, event);
  }
}

function addOutput(box, out) {
  const kind = out.output_type;
  if (kind === "stream") {
    const last = box.lastElementChild;
    if (last && last.dataset.stream === out.name) last.textContent += out.text;
    else box.append(el("pre", { class: "stream " + out.name, "data-stream": out.name }, out.text));
  } else if (kind === "display_data" || kind === "execute_result" || kind === "update_display_data") {
    box.append(mimeBundle(out.data || {}));
  } else if (kind === "error") {
    box.append(el("pre", { class: "error" }, stripAnsi((out.traceback || []).join("\n")) || out.ename + ": " + out.evalue));
  } else if (kind === "clear_output") {
    box.replaceChildren();
  } else if (kind === "dropped") {
    box.append(el("div", { class: "note" }, "… " + out.bytes + " characters of output not shown here (they are in the observation and the export)"));
  }
}

function mimeBundle(data) {
  for (const type of ["image/png", "image/jpeg", "image/gif"]) {
    if (data[type]) return el("img", { class: "figure", alt: "figure", src: "data:" + type + ";base64," + String(data[type]).trim() });
  }
  if (data["text/html"] || data["image/svg+xml"]) {
    const html = [].concat(data["text/html"] || data["image/svg+xml"]).join("");
    // No allow-scripts: no script, form, popup or navigation of this page from the output.
    const frame = el("iframe", { class: "html", sandbox: "allow-same-origin", referrerpolicy: "no-referrer", title: "HTML output" });
    frame.addEventListener("load", () => fitHeight(frame));
    frame.srcdoc = html;
    return frame;
  }
  return el("pre", { class: "stream" }, [].concat(data["text/plain"] || "").join(""));
}

const MAX_FRAME_PX = 600;  // taller outputs scroll inside their frame (and it can be resized)

function fitHeight(frame) {
  // The root element's own box: its scrollHeight is never less than the frame's viewport.
  const page = frame.contentDocument && frame.contentDocument.documentElement;
  if (page) frame.style.height = Math.min(Math.ceil(page.getBoundingClientRect().height) + 2, MAX_FRAME_PX) + "px";
}

function sessionInLink(kind = "session") {
  const match = new RegExp("^#" + kind + "=(.+)$").exec(location.hash);
  return match ? decodeURIComponent(match[1]) : null;
}

// -- ended episodes (the server's episode store) -------------------------------------------

async function refreshKept() {
  try {
    const body = await (await api("/episodes?limit=" + PAGE)).json();
    const ended = body.episodes.filter((e) => e.state !== "running");
    $("kept").replaceChildren(...ended.map(keptRow));
    $("kept-list").hidden = false;
  } catch (error) {
    $("kept-list").hidden = true;  // a server that keeps no episodes (404), or no token yet
  }
}

function keptRow(e) {
  const row = el("tr", { "data-episode": e.episode_id });
  const ended = e.ended ? new Date(e.ended * 1000).toLocaleString() : "";
  const cells = [e.episode_id.slice(0, 8), e.task, String(e.steps), e.reward === null ? "" : String(e.reward), e.state, ended];
  for (const text of cells) row.append(el("td", {}, text));
  if (e.episode_id === stored) row.classList.add("selected");
  row.addEventListener("click", () => showStored(e.episode_id));
  return row;
}

const joined = (text) => [].concat(text ?? "").join("");

async function showStored(episodeId) {
  ++watch;  // stop following a live session
  selected = null;
  stored = episodeId;
  $("episode").hidden = false;
  $("download-html").hidden = true;
  $("cells").replaceChildren();
  $("episode-id").textContent = episodeId;
  const link = "#episode=" + encodeURIComponent(episodeId);
  $("session-link").href = link;
  if (location.hash !== link) history.replaceState(null, "", link);
  for (const row of $("kept").children) row.classList.toggle("selected", row.dataset.episode === episodeId);
  try {
    const nb = await (await api("/episodes/" + encodeURIComponent(episodeId) + "/notebook")).json();
    renderStored(nb);
  } catch (error) {
    $("status").textContent = error.message;
  }
}

function renderStored(nb) {
  $("title").textContent = nb.metadata.title || "(no task)";
  document.title = "kernel_env: " + (nb.metadata.title || stored);
  for (const c of nb.cells) {
    if ((c.metadata.tags || []).includes("kernel-env-setup")) continue;
    if (c.cell_type === "markdown") {
      $("cells").append(el("div", { class: "note" }, joined(c.source)));
      continue;
    }
    const node = el("div", { class: "cell" });
    node.append(el("div", { class: "prompt" }, "In [" + (c.execution_count ?? " ") + "]:"));
    node.append(el("pre", { class: "code" }, joined(c.source)));
    const box = el("div", { class: "outputs" });
    for (const out of c.outputs || []) {
      const data = Object.fromEntries(Object.entries(out.data || {}).map(([k, v]) => [k, k.startsWith("image/") && k !== "image/svg+xml" ? v : joined(v)]));
      addOutput(box, { ...out, text: joined(out.text), data });
    }
    node.append(box);
    $("cells").append(node);
  }
}

function endStep(node, event) {
  node.classList.remove("running");
  if (event.success === false) node.classList.add("failed");
  const count = event.execution_count === null || event.execution_count === undefined ? " " : event.execution_count;
  const seconds = event.seconds === undefined ? "" : "  (" + event.seconds + " s)";
  node.querySelector(".prompt").textContent = "In [" + count + "]:" + seconds + (event.error ? "  " + event.error : "");
  for (const call of event.llm_calls || []) {
    const details = el("details", { class: "llm" });
    details.append(el("summary", {}, call.op + (call.error ? " (failed)" : "") + ": " + call.prompt.slice(0, 80)));
    details.append(el("div", {}, "prompt"), el("pre", {}, call.prompt), el("div", {}, "answer"), el("pre", {}, call.response));
    node.append(details);
  }
  if (event.done) {
    const reward = event.reward === null || event.reward === undefined ? "" : "   reward " + event.reward;
    $("cells").append(el("div", { class: "final" }, "final answer: " + (event.final_answer ?? "(none)") + reward));
  }
}

function stripAnsi(text) {
  return text.replace(/\u001b\[[0-9;?]*[ -/]*[@-~]/g, "");
}

async function download(kind) {
  if (!selected && !stored) return;
  const path = stored
    ? "/episodes/" + encodeURIComponent(stored) + "/notebook"
    : "/sessions/" + encodeURIComponent(selected) + (kind === "html" ? "/notebook.html" : "/notebook");
  try {
    const blob = await (await api(path)).blob();
    const link = el("a", { href: URL.createObjectURL(blob), download: (stored || selected) + (kind === "html" ? ".html" : ".ipynb") });
    link.click();
    URL.revokeObjectURL(link.href);
  } catch (error) {
    $("status").textContent = error.message;
  }
}

document.addEventListener("DOMContentLoaded", () => {
  $("login").addEventListener("submit", (event) => {
    event.preventDefault();
    sessionStorage.setItem(TOKEN_KEY, $("token").value);
    $("login").hidden = true;
    refreshSessions();
    refreshKept();
  });
  $("previous-page").addEventListener("click", () => turnPage(false));
  $("next-page").addEventListener("click", () => turnPage(true));
  $("download-ipynb").addEventListener("click", () => download("ipynb"));
  $("download-html").addEventListener("click", () => download("html"));
  window.addEventListener("hashchange", () => {
    const linked = sessionInLink();
    if (linked && linked !== selected) show(linked);
    const episode = sessionInLink("episode");
    if (episode && episode !== stored) showStored(episode);
  });
  const linked = sessionInLink();
  if (linked) show(linked);
  const episode = sessionInLink("episode");
  if (episode) showStored(episode);
  refreshSessions();
  refreshKept();
  setInterval(refreshSessions, 2000);
  setInterval(refreshKept, 5000);
});
