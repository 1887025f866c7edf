// The report's table: sorting, filtering and a detail row per call. Data is only ever inserted
// with textContent, never as markup, so names from the model cannot become HTML.
(function () {
  "use strict";
  var table = document.getElementById("hs-trace");
  if (!table) { return; }
  var body = table.tBodies[0];
  var rows = Array.prototype.slice.call(body.querySelectorAll("tr.row"));
  var filter = document.getElementById("hs-filter");
  var badOnly = document.getElementById("hs-bad-only");
  var counter = document.getElementById("hs-count");
  var details = null; // parsed on first use: the page shows before a large JSON is read
  var SVG = "http://www.w3.org/2000/svg";

  function detailsData() {
    if (details === null) {
      details = JSON.parse(document.getElementById("hs-details").textContent);
    }
    return details;
  }

  function el(tag, text, cls) {
    var node = document.createElement(tag);
    if (text !== undefined && text !== null) { node.textContent = String(text); }
    if (cls) { node.className = cls; }
    return node;
  }

  function collapse(row) {
    var next = row.nextElementSibling;
    if (next && next.classList.contains("detail")) { next.parentNode.removeChild(next); }
    row.classList.remove("open");
    row.setAttribute("aria-expanded", "false");
  }

  function collapseAll() { rows.forEach(collapse); }

  function histogram(data) {
    var width = 260, height = 60, counts = data.counts, top = Math.max.apply(null, counts) || 1;
    var svg = document.createElementNS(SVG, "svg");
    svg.setAttribute("width", width);
    svg.setAttribute("height", height + 14);
    svg.setAttribute("role", "img");
    var step = width / counts.length;
    counts.forEach(function (count, i) {
      var bar = document.createElementNS(SVG, "rect");
      var h = Math.max(count > 0 ? 1 : 0, height * count / top);
      bar.setAttribute("x", (i * step).toFixed(2));
      bar.setAttribute("y", (height - h).toFixed(2));
      bar.setAttribute("width", Math.max(step - 0.5, 0.5).toFixed(2));
      bar.setAttribute("height", h.toFixed(2));
      bar.setAttribute("fill", "#3182bd");
      svg.appendChild(bar);
    });
    [[0, "start", data.low], [width, "end", data.high]].forEach(function (spec) {
      var label = document.createElementNS(SVG, "text");
      label.setAttribute("x", spec[0]);
      label.setAttribute("y", height + 12);
      label.setAttribute("text-anchor", spec[1]);
      label.setAttribute("font-size", "10");
      label.textContent = Number(spec[2]).toPrecision(4);
      svg.appendChild(label);
    });
    return svg;
  }

  function tensors(title, items) {
    var box = el("div");
    box.appendChild(el("h4", title));
    if (!items.length) { box.appendChild(el("p", "no tensors")); return box; }
    var t = el("table");
    var head = el("tr");
    ["leaf", "shape", "dtype", "device", "min", "max", "mean", "std", "mean |x|", "zeros", "NaN", "±Inf", "from"].forEach(function (h) { head.appendChild(el("th", h)); });
    t.appendChild(head);
    items.forEach(function (item) {
      var tr = el("tr");
      var s = item.stats || {};
      [item.leaf, item.shape, item.dtype, item.device, s.min, s.max, s.mean, s.std, s.abs_mean, s.zeros, s.nan, s.inf, item.source || ""].forEach(function (v) { tr.appendChild(el("td", v === undefined ? "" : v)); });
      t.appendChild(tr);
    });
    box.appendChild(t);
    return box;
  }

  function expand(row) {
    var data = detailsData()[Number(row.getAttribute("data-i"))];
    var tr = el("tr", null, "detail");
    var td = el("td");
    td.colSpan = row.cells.length;
    var box = el("div", null, "detail");
    box.appendChild(el("h4", data.site + " · " + data.cls + (data.params ? " · " + data.params.toLocaleString() + " own parameters" : "")));
    if (data.status !== "ok") { box.appendChild(el("p", "an exception went through this call")); }
    box.appendChild(tensors("inputs", data.inputs));
    box.appendChild(tensors("outputs", data.outputs));
    if (data.histogram) {
      box.appendChild(el("h4", "distribution of the output (" + data.histogram.counted.toLocaleString() + " of " + data.histogram.total.toLocaleString() + " values counted)"));
      box.appendChild(histogram(data.histogram));
    }
    td.appendChild(box);
    tr.appendChild(td);
    row.parentNode.insertBefore(tr, row.nextSibling);
    row.classList.add("open");
    row.setAttribute("aria-expanded", "true");
  }

  function toggle(row) {
    if (row.classList.contains("open")) { collapse(row); } else { expand(row); }
  }

  body.addEventListener("click", function (event) {
    var row = event.target.closest("tr.row");
    if (row) { toggle(row); }
  });
  body.addEventListener("keydown", function (event) {
    var row = event.target.closest("tr.row");
    if (row && (event.key === "Enter" || event.key === " ")) { event.preventDefault(); toggle(row); }
  });

  function value(row, index, type) {
    var cell = row.cells[index];
    var raw = cell.hasAttribute("data-v") ? cell.getAttribute("data-v") : cell.textContent;
    if (type === "num") {
      var number = parseFloat(raw);
      return isNaN(number) ? -Infinity : number;
    }
    return raw.trim().toLowerCase();
  }

  Array.prototype.forEach.call(table.tHead.rows[0].cells, function (th, index) {
    th.addEventListener("click", function () {
      var type = th.getAttribute("data-type");
      var ascending = th.getAttribute("aria-sort") !== "ascending";
      Array.prototype.forEach.call(table.tHead.rows[0].cells, function (other) { other.setAttribute("aria-sort", "none"); });
      th.setAttribute("aria-sort", ascending ? "ascending" : "descending");
      collapseAll();
      var keyed = rows.map(function (row, position) { return [value(row, index, type), position, row]; });
      keyed.sort(function (a, b) {
        var order = a[0] < b[0] ? -1 : a[0] > b[0] ? 1 : 0;
        return (ascending ? order : -order) || a[1] - b[1];
      });
      var fragment = document.createDocumentFragment();
      keyed.forEach(function (item) { fragment.appendChild(item[2]); });
      body.appendChild(fragment);
      rows = keyed.map(function (item) { return item[2]; });
    });
  });

  function applyFilter() {
    var words = filter.value.trim().toLowerCase().split(/\s+/).filter(Boolean);
    var shown = 0;
    rows.forEach(function (row) {
      var name = row.getAttribute("data-name");
      var visible = words.every(function (word) { return name.indexOf(word) !== -1; }) && (!badOnly.checked || row.classList.contains("bad"));
      if (!visible) { collapse(row); }
      row.classList.toggle("hidden", !visible);
      if (visible) { shown += 1; }
    });
    counter.textContent = shown + " of " + rows.length + " calls";
  }

  filter.addEventListener("input", applyFilter);
  badOnly.addEventListener("change", applyFilter);
  document.getElementById("hs-collapse").addEventListener("click", collapseAll);
}());
