-- Monthly revenue by region, with each region's share of the month's total.
WITH orders_in_month AS (
    SELECT
        o.id,
        o.customer_id,
        o.total_cents,
        date_trunc('month', o.placed_at) AS month
    FROM orders AS o
    WHERE o.status = 'paid'
      AND o.placed_at >= DATE '2025-01-01'
),
by_region AS (
    SELECT
        m.month,
        c.region,
        COUNT(*) AS orders,
        SUM(m.total_cents) AS revenue_cents
    FROM orders_in_month AS m
    JOIN customers AS c ON c.id = m.customer_id
    GROUP BY m.month, c.region
)
SELECT
    b.month,
    b.region,
    b.orders,
    b.revenue_cents / 100.0 AS revenue,
    ROUND(100.0 * b.revenue_cents / SUM(b.revenue_cents) OVER (PARTITION BY b.month), 1) AS share
FROM by_region AS b
ORDER BY b.month, b.revenue_cents DESC;
