// A virtualised list over millions of rows: only the rows in view exist in the DOM, and rows
// arrive in pages fetched by begin/end. Past a few million pixels browsers stop growing a
// scroll area, so a long list maps the scroll position onto the row range proportionally.

import { h, clear } from "./util.js";

const MAX_PX = 4_000_000;
const MAX_PAGES = 80;

export class VirtualList {
  /**
   * @param {HTMLElement} container
   * @param {{rowHeight?: number, pageSize?: number,
   *          fetchPage: (begin: number, end: number) => Promise<{begin: number, total: number, items: any[]}>,
   *          renderRow: (item: any, index: number) => HTMLElement,
   *          onTotal?: (total: number) => void, onError?: (err: Error) => void}} opts
   */
  constructor(container, opts) {
    this.opts = { rowHeight: 26, pageSize: 200, ...opts };
    this.spacer = h("div.vl-spacer");
    this.win = h("div.vl-window");
    this.scroll = h("div.vl-scroll", { tabindex: "0" }, this.spacer, this.win);
    container.append(this.scroll);
    this.total = 0;
    this.pages = new Map();
    this.pending = new Set();
    this.gen = 0;
    this.loadTimer = null;
    this.scroll.addEventListener("scroll", () => this.render());
    this.resize = new ResizeObserver(() => this.render());
    this.resize.observe(this.scroll);
  }

  destroy() {
    this.resize.disconnect();
    this.gen++;
  }

  /** Forget every page (new filters) and show ``total`` rows. */
  reset(total) {
    this.gen++;
    this.pages.clear();
    this.pending.clear();
    this.scroll.scrollTop = 0;
    this.setTotal(total);
  }

  /** The row count changed (a live run grew): keep full pages, drop the partial last one. */
  setTotal(total) {
    if (total !== this.total) {
      for (const [no, page] of this.pages) {
        if (page.items.length < this.opts.pageSize) this.pages.delete(no);
      }
    }
    this.total = total;
    this.spacer.style.height = `${Math.min(total * this.opts.rowHeight, MAX_PX)}px`;
    if (this.opts.onTotal) this.opts.onTotal(total);
    this.render();
  }

  get scaled() {
    return this.total * this.opts.rowHeight > MAX_PX;
  }

  visibleRows() {
    return Math.ceil((this.scroll.clientHeight || 400) / this.opts.rowHeight) + 1;
  }

  firstIndex() {
    const rh = this.opts.rowHeight;
    if (!this.scaled) return Math.floor(this.scroll.scrollTop / rh);
    const maxTop = this.scroll.scrollHeight - this.scroll.clientHeight;
    const frac = maxTop > 0 ? Math.min(1, this.scroll.scrollTop / maxTop) : 0;
    return Math.round(frac * Math.max(0, this.total - this.visibleRows() + 2));
  }

  item(i) {
    const ps = this.opts.pageSize;
    const page = this.pages.get(Math.floor(i / ps));
    return page ? page.items[i - page.begin] : undefined;
  }

  render() {
    const rh = this.opts.rowHeight;
    const first = Math.max(0, Math.min(this.firstIndex(), Math.max(0, this.total - 1)));
    const last = Math.min(this.total, first + this.visibleRows());
    this.win.style.top = `${this.scaled ? this.scroll.scrollTop : first * rh}px`;
    const rows = [];
    let missing = false;
    for (let i = first; i < last; i++) {
      const item = this.item(i);
      if (item === undefined) {
        missing = true;
        rows.push(h("div.vl-row.loading", { dataset: { index: i } }, h("span.seq", "…")));
      } else {
        const row = this.opts.renderRow(item, i);
        row.dataset.index = i;
        rows.push(row);
      }
    }
    clear(this.win, rows);
    this.first = first;
    this.last = last;
    if (missing) this.loadSoon();
  }

  /** Fetch what is in view once scrolling pauses: dragging across a million rows asks for nothing. */
  loadSoon() {
    clearTimeout(this.loadTimer);
    this.loadTimer = setTimeout(() => this.loadVisible(), 40);
  }

  loadVisible() {
    const ps = this.opts.pageSize;
    for (let p = Math.floor(this.first / ps); p <= Math.floor(Math.max(this.first, this.last - 1) / ps); p++) {
      if (!this.pages.has(p)) this.load(p);
    }
  }

  async load(pageNo) {
    if (this.pending.has(pageNo)) return;
    this.pending.add(pageNo);
    const gen = this.gen;
    const ps = this.opts.pageSize;
    try {
      const res = await this.opts.fetchPage(pageNo * ps, (pageNo + 1) * ps);
      if (gen !== this.gen) return;
      this.pages.set(pageNo, { begin: res.begin, items: res.items });
      if (this.pages.size > MAX_PAGES) this.pages.delete(this.pages.keys().next().value);
      if (res.total !== this.total) this.setTotal(res.total);
      else this.render();
    } catch (err) {
      if (this.opts.onError) this.opts.onError(err);
    } finally {
      if (gen === this.gen) this.pending.delete(pageNo);
    }
  }

  /** Scroll so that row ``i`` is in view (centred when it was not). */
  scrollToIndex(i) {
    if (i >= this.first && i < this.last - 1 && this.last > this.first) {
      this.render();
      return;
    }
    const rh = this.opts.rowHeight;
    const view = this.scroll.clientHeight;
    if (!this.scaled) {
      this.scroll.scrollTop = Math.max(0, i * rh - view / 2 + rh / 2);
    } else {
      const rows = this.visibleRows();
      const maxTop = this.scroll.scrollHeight - view;
      const frac = Math.max(0, i - Math.floor(rows / 2)) / Math.max(1, this.total - rows + 2);
      this.scroll.scrollTop = Math.min(maxTop, frac * maxTop);
    }
    this.render();
  }
}
