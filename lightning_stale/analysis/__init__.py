"""Reading finished runs (`runs`) and drawing the paper's figures from them (`plot`)."""
