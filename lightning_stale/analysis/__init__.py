"""Reading finished runs (`runs`) and drawing the paper's figures from them (`plot`); the
advisor from a recorded trace to a variant and K (`sweeps`, `advise`, `advise_plot`)."""
