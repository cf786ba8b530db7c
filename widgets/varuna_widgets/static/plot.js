// One Plotly figure, synced by replacement (see plot.py). Python replaces the `figure` trait
// ({data, layout}) whole; every render and every change draws the newest figure with
// Plotly.react, so a view that renders late, or misses changes while busy, still shows the
// current state: there are no deltas to lose or apply out of order.

const KEY = "__varunaPlotly";

// plotly.min.js is a UMD bundle: given a CommonJS `module`, it exports Plotly there and leaves
// the page's globals alone. Evaluated once per page; every view shares it.
function plotly(model) {
  if (!globalThis[KEY]) {
    const module = { exports: {} };
    new Function("module", "exports", model.get("_plotly_js"))(module, module.exports);
    globalThis[KEY] = module.exports;
  }
  return globalThis[KEY];
}

// Plotly measures its container: wait until the view is in the document.
function attached(el) {
  return new Promise((resolve) => {
    const check = () => (el.isConnected ? resolve() : requestAnimationFrame(check));
    check();
  });
}

function render({ model, el }) {
  const Plotly = plotly(model);
  const div = document.createElement("div");
  el.appendChild(div);
  let queued = false;
  let chain = attached(div);
  // At most one draw waits at a time, and it reads the figure when it runs: a burst of changes
  // costs one redraw of the newest.
  const draw = () => {
    if (queued) return;
    queued = true;
    chain = chain
      .then(() => {
        queued = false;
        const fig = structuredClone(model.get("figure") || {}); // Plotly writes into what it is given
        return Plotly.react(div, fig.data || [], fig.layout || {}, { displaylogo: false, responsive: true });
      })
      .catch((err) => console.error("varuna PlotView: draw failed", err));
  };
  draw();
  model.on("change:figure", draw);
  return () => {
    model.off("change:figure", draw);
    Plotly.purge(div);
  };
}

export default { render };
